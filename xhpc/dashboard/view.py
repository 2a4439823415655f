"""`xhpc top`'s frames (pure): an ``Overview`` and the proxy's traffic in, rich renderables out.

Every value that comes from outside (names, Slurm's reasons, events' messages) goes into a
``Text`` (never parsed as markup) with its control characters replaced, so that no name or
message can restyle the screen or send the terminal an escape sequence. Times are shown
relative to the overview's ``taken_at``, so a frame depends on its inputs only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from xhpc.dashboard.overview import Overview
from xhpc.dashboard.spans import span
from xhpc.dashboard.traffic import ModelTraffic
from xhpc.models import DeploymentView, ReplicaOutlook, ReplicaState, ReplicaView
from xhpc.placement.views import GpuView, NodeView
from xhpc.records import EventRecord

S = ReplicaState
_STATE_STYLE = {
    S.READY: "green",
    S.QUEUED: "yellow",
    S.STARTING: "cyan",
    S.CREATING: "cyan",
    S.DRAINING: "magenta",
    S.LOST: "red",
    S.FAILED: "red",
}
MAX_CELL = 120  # longer values (reasons, messages) are cut


@dataclass(frozen=True)
class Screen:
    """What the frame shows besides the data: the filter, the traffic's source and state."""

    filter: str = ""
    typing: bool = False  # the filter is being typed (keys go to it)
    traffic_note: str | None = None  # why there is no traffic table (no proxy, refused)
    stale_note: str | None = None  # the broker did not answer the last refresh
    keys: bool = True  # show the key help (not with --once)


def clean(value: object, limit: int = MAX_CELL) -> str:
    """``value`` as one printable line: control characters (escapes, newlines) become "?"."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _t(value: object, style: str = "") -> Text:
    return Text(clean(value), style=style)


def _until(at: datetime | None, now: datetime, past: str = "due") -> str:
    if at is None:
        return "-"
    left = (at - now).total_seconds()
    return past if left <= 0 else f"in {span(left)}"


def matches(text: str, needle: str) -> bool:
    return not needle or needle.casefold() in text.casefold()


# -- nodes ------------------------------------------------------------------------------------


def _holder(gpu: GpuView, replica_of_job: dict[str, str]) -> Text:
    if gpu.slurm_jobs:
        names = [replica_of_job.get(j, f"job {j}") for j in gpu.slurm_jobs]
        return _t(", ".join(names))
    if gpu.unattributed:
        return _t("in use (no index)", "yellow")
    return _t("free", "dim")


def _health(gpu: GpuView, node: NodeView) -> Text:
    if node.probe_age_s is None:
        return _t("no probe", "dim")
    if node.probe_stale:
        return _t(f"stale probe ({span(node.probe_age_s)})", "yellow")
    if not gpu.healthy:
        return _t(f"UNHEALTHY {gpu.error or ''}".strip(), "red")
    return _t("foreign process", "yellow") if gpu.foreign else _t("ok", "green")


def _util(gpu: GpuView, fresh: bool) -> str:
    return f"{gpu.util_pct:.0f}%" if fresh and gpu.util_pct is not None else "-"


def _memory(gpu: GpuView, fresh: bool) -> str:
    if not fresh or gpu.mem_used_mb is None or not gpu.mem_total_mb:
        return "-"
    return f"{gpu.mem_used_mb / 1024:.1f}/{gpu.mem_total_mb / 1024:.1f} GiB"


def _table(title: str) -> Table:
    """One of the frame's tables: titled on the left, a rule under the head, no outer edge."""
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )


def nodes_table(ov: Overview) -> Table:
    replica_of_job = {r.job_id: r.replica_id for r in ov.replicas() if r.job_id}
    table = _table("nodes")
    for col in ("node", "state", "free/total", "rsv", "gpu", "Slurm", "util", "memory", "health"):
        table.add_column(col, no_wrap=col in ("node", "gpu", "util", "memory"))
    for node in ov.nodes.nodes:
        state = "+".join((node.state, *node.state_flags)) + (
            f" ({node.reason})" if node.reason else ""
        )
        head = [
            _t(node.name, "bold"),
            _t(state, "" if node.usable else "red"),
            _t(f"{node.free}/{node.gpus_total}"),
            _t(node.reserved or "-"),
        ]
        if not node.gpus:
            table.add_row(*head, "-", "-", "-", "-", _t("no GPUs", "dim"), end_section=True)
        for i, gpu in enumerate(node.gpus):
            table.add_row(
                *(head if i == 0 else ["", "", "", ""]),
                _t(gpu.index),
                _holder(gpu, replica_of_job),
                _util(gpu, node.probe_fresh),
                _memory(gpu, node.probe_fresh),
                _health(gpu, node),
                end_section=i == len(node.gpus) - 1,
            )
    return table


# -- deployments and replicas -------------------------------------------------------------------


def _deployment_row(dep: DeploymentView, engines: bool) -> list[Text | str]:
    if dep.failed_reason:
        state = _t(f"FAILED: {dep.failed_reason}", "red")
    else:
        ready = sum(r.state is S.READY for r in dep.replicas)
        style = "green" if ready >= dep.wanted > 0 else "yellow"
        state = _t(f"{ready}/{dep.wanted} READY", style)
    detail = f"{dep.engine.value}, {dep.gpus} GPU(s) each, restart={dep.restart.value}"
    if dep.scaling is not None:
        asleep = ", asleep" if dep.wanted == 0 and not dep.stopped else ""
        detail += f", {dep.scaling.shown()}{asleep}"
    blank = 9 if engines else 7
    return [_t(dep.name, "bold"), state, *[""] * blank, _t(detail, "dim")]


def _engine(out: ReplicaOutlook | None) -> tuple[str, str]:
    """Its engine's queue (running/waiting) and KV-cache use, or "-" where not known."""
    if out is None:
        return "-", "-"
    queue = "-"
    if out.engine_running is not None and out.engine_waiting is not None:
        queue = f"{out.engine_running}/{out.engine_waiting}"
    return queue, "-" if out.kv_use is None else f"{out.kv_use:.0%}"


def _replica_row(
    r: ReplicaView, out: ReplicaOutlook | None, now: datetime, engines: bool
) -> list[Text | str]:
    role = f" ({r.role.value} of {r.unit})" if r.role and r.unit else ""
    estimate = out.start_estimate if out else None
    if out is not None and out.successor:
        handover = f"to {out.successor}"
    else:
        handover = _until(out.handover_at if out else None, now)
    return [
        _t(f"  {r.replica_id}{role}"),
        _t(r.state.value, _STATE_STYLE.get(r.state, "")),
        _t(r.job_id or "-"),
        _t(out.node_shown(r.node) if out else r.node or "-"),
        _t(",".join(map(str, r.gpus)) or "-"),
        _t(out.in_flight if out else 0),
        *(map(_t, _engine(out)) if engines else ()),
        _t(_until(estimate, now, past="now?") if estimate else "-"),
        _t(span((r.ends_at - now).total_seconds()) if r.ends_at else "-"),
        _t(handover),
        _t(r.reason or ""),
    ]


def deployments_table(ov: Overview, needle: str = "") -> Table:
    """The deployments and their replicas; the engines' own queue (requests running/waiting)
    and KV-cache use once the broker has scraped any engine ("-" for the others)."""
    outlook = ov.outlook_of()
    engines = any(o.engine_running is not None or o.kv_use is not None for o in outlook.values())
    table = _table("deployments")
    shown = ("run/wait", "kv") if engines else ()
    for col in (
        "replica", "state", "job", "node", "gpus", "in flight", *shown, "starts", "left",
        "handover", "why",
    ):  # fmt: skip
        table.add_column(col, no_wrap=col != "why")
    for dep in ov.deployments:
        replicas = [
            r for r in dep.replicas if matches(dep.name, needle) or matches(r.replica_id, needle)
        ]
        if not (replicas or matches(dep.name, needle)):
            continue
        table.add_row(*_deployment_row(dep, engines))
        for r in replicas:
            table.add_row(*_replica_row(r, outlook.get(r.replica_id), ov.taken_at, engines))
        table.add_section()
    return table


# -- traffic and events -------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def traffic_table(rows: Sequence[ModelTraffic], needle: str = "") -> Table:
    windows = [r.window_s for r in rows if r.window_s]
    over = f" (last {span(max(windows))})" if windows else ""
    table = _table(f"proxy traffic{over}")
    for col in ("model", "req/s", "answered", "p50", "p99", "5xx/s", "in flight"):
        table.add_column(col, no_wrap=True, justify="left" if col == "model" else "right")
    for r in rows:
        if not matches(r.model, needle):
            continue
        errors = _t(_per_s(r.errors_per_s), "red" if r.errors_per_s else "")
        table.add_row(
            _t(r.model, "bold"),
            _per_s(r.requests_per_s),
            str(r.requests_total),
            _seconds(r.p50_s),
            _seconds(r.p99_s),
            errors,
            str(r.in_flight),
        )
    return table


def _event_matches(e: EventRecord, needle: str) -> bool:
    return any(matches(v, needle) for v in (e.deployment or "", e.replica_id or "", e.message))


def events_table(events: Iterable[EventRecord], needle: str = "") -> Table:
    table = _table("recent events")
    for col in ("time (UTC)", "replica", "kind", "event"):
        table.add_column(col, no_wrap=col != "event")
    for e in sorted(events, key=lambda e: e.id, reverse=True):  # newest first
        if _event_matches(e, needle):
            who = e.replica_id or e.deployment or "-"
            table.add_row(f"{e.at:%H:%M:%S}", _t(who), _t(e.kind), _t(e.message))
    return table


# -- the frame ----------------------------------------------------------------------------------


def header(ov: Overview, screen: Screen) -> Text:
    line = Text()
    line.append("xhpc top", style="bold")
    line.append(f"  {ov.taken_at:%Y-%m-%d %H:%M:%S} UTC")
    line.append(f"  Slurm view {ov.slurm_age_s:.1f}s old")
    line.append(f"  proxies heard: {ov.proxies}")
    if screen.filter or screen.typing:
        line.append("  filter: ")
        line.append(clean(screen.filter) + ("_" if screen.typing else ""), style="bold yellow")
    if screen.stale_note:
        line.append(f"  {clean(screen.stale_note)}", style="red")
    if screen.keys:
        keys = "  [enter] apply  [esc] clear" if screen.typing else "  [/] filter  [q] quit"
        line.append(keys, style="dim")
    return line


def frame(ov: Overview, traffic: Sequence[ModelTraffic], screen: Screen) -> RenderableType:
    """One whole screen: header, nodes x GPUs, deployments and replicas, the proxy's traffic
    per model, recent events. ``screen.filter`` (any case) keeps the deployments whose name
    holds it (or only their replicas whose name does), the traffic of those models, and the
    events whose deployment, replica or message holds it; the nodes are the whole cluster's."""
    parts: list[RenderableType] = [header(ov, screen), nodes_table(ov)]
    parts.append(deployments_table(ov, screen.filter))
    if screen.traffic_note:
        parts.append(_t(f"proxy traffic: {screen.traffic_note}", "dim"))
    elif not traffic:
        parts.append(_t("proxy traffic: no request answered yet", "dim"))
    else:
        parts.append(traffic_table(traffic, screen.filter))
    parts.append(events_table(ov.events, screen.filter))
    return Group(*parts)
