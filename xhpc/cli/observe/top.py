"""`xhpc top`: a live dashboard of the serving plane.

Each refresh is one call to the broker (``GET /v1/overview``: built from its shared Slurm view,
so a dashboard costs Slurm nothing however many run) and one scrape of the proxy's
``/metrics`` (rates from successive scrapes). The frames are drawn by xhpc.dashboard.view.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import click
from rich.console import Console
from rich.live import Live

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.client.control import Client
from xhpc.client.metrics import metrics_url, scrape
from xhpc.dashboard.overview import MAX_EVENTS, Overview
from xhpc.dashboard.traffic import ModelTraffic, TrafficWindow, parse_metrics
from xhpc.dashboard.view import Screen, clean, frame
from xhpc.errors import ValidationError, XhpcError

TRAFFIC_WINDOW_S = 10.0


class TrafficFeed:
    """The proxy's traffic per model, from its /metrics scraped once per refresh."""

    def __init__(self, url: str | None, window_s: float = TRAFFIC_WINDOW_S) -> None:
        self.url = url
        self.window = TrafficWindow(window_s)
        self.note: str | None = None if url else "the proxy's port is not known (port 0)"

    def scrape(self) -> bool:
        """One more sample; False (and ``note`` says why) when the proxy did not answer."""
        if self.url is None:
            return False
        try:
            text = scrape(self.url)
        except XhpcError as err:
            self.note = err.one_line()
            return False
        self.window.add(parse_metrics(text, time.monotonic()))
        self.note = None
        return True

    def rows(self, ov: Overview) -> tuple[ModelTraffic, ...]:
        if self.note is not None:
            return ()
        return self.window.traffic({r.replica_id: r.deployment for r in ov.replicas()})


def _once(
    broker: Client, feed: TrafficFeed, events: int, interval_s: float
) -> tuple[Overview, tuple[ModelTraffic, ...]]:
    """An overview and the traffic over one interval (two scrapes, when the proxy answers)."""
    if feed.scrape():
        time.sleep(interval_s)
        feed.scrape()
    ov = broker.overview(events)
    return ov, feed.rows(ov)


def _live(
    broker: Client, feed: TrafficFeed, events: int, interval_s: float, screen: Screen
) -> None:
    from xhpc.cli.observe.terminal import KeyReader
    from xhpc.dashboard.keys import on_keys

    ov = broker.overview(events)  # the first answer must come: else one line and exit
    feed.scrape()
    console = Console()
    with (
        KeyReader(sys.stdin.fileno()) as keys,
        Live(console=console, screen=True, auto_refresh=False, transient=True) as live,
    ):
        due = time.monotonic() + interval_s
        while True:
            screen = replace(screen, traffic_note=feed.note)
            live.update(frame(ov, feed.rows(ov), screen), refresh=True)
            typed = keys.read(due - time.monotonic())
            if typed is None:
                return
            if typed:
                after = on_keys(screen, typed)
                if after is None:
                    return
                screen = after
            if time.monotonic() >= due:
                due = time.monotonic() + interval_s
                try:
                    ov = broker.overview(events)
                    screen = replace(screen, stale_note=None)
                except XhpcError as err:  # keep the last frame; say so
                    screen = replace(screen, stale_note=f"broker: {err.one_line()}")
                feed.scrape()


@click.command()
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(0.2, 60.0),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option("--filter", "filter_", default="", help="Show only models whose name holds this.")
@click.option(
    "--events",
    type=click.IntRange(0, MAX_EVENTS),
    default=10,
    show_default=True,
    help="Recent events shown.",
)
@click.option("--metrics", "metrics", default=None, help="The proxy's /metrics URL.")
@click.option("--json", "as_json", is_flag=True, help="The overview and traffic as JSON, once.")
@pass_ctx
def top(
    ctx: Ctx,
    once: bool,
    interval_s: float,
    filter_: str,
    events: int,
    metrics: str | None,
    as_json: bool,
) -> None:
    """Live dashboard: nodes, GPUs, replicas, proxy traffic, recent events.

    Nodes x GPUs (Slurm's allocation, the probes' utilisation, memory and health, open
    reservations), deployments and replicas (state, Slurm's queue reason and start estimate,
    time left in the job, next walltime handover), the proxy's traffic per model, and the
    broker's recent events, refreshed every --interval. Keys: / filter by model, Esc clear,
    q quit.

    The proxy's figures come from its /metrics (default: proxy.metrics_listen, else the
    gateway's port, which needs an admin key when keys are on: then no traffic is shown)."""
    if not (once or as_json) and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ValidationError("xhpc top needs a terminal; use --once or --json")
    filter_ = clean(filter_, limit=64)
    feed = TrafficFeed(metrics or metrics_url(ctx.config.proxy))
    broker = ctx.broker
    if as_json or once:
        ov, traffic = _once(broker, feed, events, interval_s)
        if as_json:
            emit_json(
                {
                    "overview": ov.model_dump(mode="json"),
                    "traffic": [t.model_dump(mode="json") for t in traffic],
                    "traffic_note": feed.note,
                }
            )
            return
        screen = Screen(filter=filter_, traffic_note=feed.note, keys=False)
        ctx.console.print(frame(ov, traffic, screen))
        return
    _live(broker, feed, events, interval_s, Screen(filter=filter_))
