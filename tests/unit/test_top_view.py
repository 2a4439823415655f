"""`xhpc top`'s frames and keys (pure): the recorded overview (tests/data/top/overview.json,
see test_top_overview.py) and proxy expositions (metrics-{1,2}.txt) in, the text a 140-column
terminal shows out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console

from xhpc.dashboard.keys import on_keys
from xhpc.dashboard.overview import Overview
from xhpc.dashboard.traffic import ModelTraffic, TrafficWindow, parse_metrics
from xhpc.dashboard.view import Screen, frame, span
from xhpc.models import ScalingPolicy
from xhpc.records import EventRecord

TOP = Path(__file__).resolve().parent.parent / "data" / "top"


def recorded() -> Overview:
    return Overview.model_validate_json((TOP / "overview.json").read_text())


def traffic(ov: Overview) -> tuple[ModelTraffic, ...]:
    window = TrafficWindow()
    window.add(parse_metrics((TOP / "metrics-1.txt").read_text(), 100.0))
    window.add(parse_metrics((TOP / "metrics-2.txt").read_text(), 110.0))
    return window.traffic({r.replica_id: r.deployment for r in ov.replicas()})


def render(ov: Overview, screen: Screen | None = None, rows: tuple[ModelTraffic, ...] = ()) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(frame(ov, rows, screen or Screen()))
    return console.export_text()


def _in_order(line: str, parts: tuple[str, ...]) -> bool:
    at = 0
    for part in parts:
        found = line.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def line_of(text: str, *parts: str) -> str:
    """The one line holding every part, in this order."""
    found = [ln for ln in text.splitlines() if _in_order(ln, parts)]
    assert len(found) == 1, (parts, found)
    return found[0]


def test_nodes_show_each_gpu_with_its_holder_probe_health_and_reservations() -> None:
    text = render(recorded())
    line_of(text, "n1", "IDLE", "3/4", "0", "tiny-llama-0", "35%", "2.0/16.0 GiB", "ok")
    line_of(text, "1", "tiny-llama-1", "5%", "2.0/16.0 GiB", "ok")
    line_of(text, "n3", "2/4", "1", "0", "free", "0%")  # tiny-llama-2's reservation on n3
    line_of(text, "3", "free", "UNHEALTHY Xid 79")


def test_replicas_show_state_queue_reason_estimate_time_left_and_handover() -> None:
    text = render(recorded())
    line_of(text, "tiny-llama", "1/3 READY", "vllm, 1 GPU(s) each, restart=always")
    # READY: 3 requests in flight (the proxies' syncs), 19m59s left, successor due in 17m59s
    line_of(text, "tiny-llama-0", "READY", "100", "n1", "0", "3", "19m59s", "in 17m59s")
    line_of(text, "tiny-llama-1", "STARTING", "101", "n2", "1", "58m59s", "job running")
    # QUEUED: Slurm's reason, and its estimate of the start (12 min after the recording)
    line_of(text, "tiny-llama-2", "QUEUED", "102", "in 11m59s", "Resources")


def test_each_engine_s_queue_and_kv_cache_once_the_broker_has_scraped_one() -> None:
    ov = recorded()
    assert "run/wait" not in render(ov)  # no engine scraped: no columns
    scraped = {"engine_running": 2, "engine_waiting": 5, "kv_use": 0.42}
    outlook = tuple(
        o.model_copy(update=scraped) if o.replica_id == "tiny-llama-0" else o for o in ov.outlook
    )
    text = render(ov.model_copy(update={"outlook": outlook}))
    line_of(text, "in flight", "run/wait", "kv", "starts")
    line_of(text, "tiny-llama-0", "READY", "3", "2/5", "42%", "19m59s", "in 17m59s")
    line_of(text, "tiny-llama-1", "STARTING", "0", "-", "-", "58m59s")  # not known: "-"


def test_traffic_per_model_and_events_newest_first() -> None:
    ov = recorded()
    text = render(ov, rows=traffic(ov))
    assert "proxy traffic (last 10s)" in text
    line_of(text, "tiny-llama", "2.0", "50", "183 ms", "4.75 s", "0.2", "3")
    line_of(text, "qwen", "0.0", "4", "-", "-", "0.0", "0")
    events = [ln for ln in text.splitlines() if ln.startswith("22:54:06")]
    assert "READY: engine answered" in events[0] and "CREATING" in events[-1]
    assert len(events) == len(ov.events)


def test_a_filter_keeps_the_models_replicas_traffic_and_events_that_match() -> None:
    ov = recorded()
    text = render(ov, Screen(filter="QWEN"), traffic(ov))
    assert "filter: QWEN" in text
    assert "tiny-llama-0" in text  # the nodes table is the whole cluster's
    assert "engine answered" not in text and "READY" not in text  # no replica, no event
    line_of(text, "qwen", "0.0", "4")
    assert "tiny-llama     2.0" not in text
    text = render(ov, Screen(filter="llama-2"))  # a replica's name: its deployment shows it
    line_of(text, "tiny-llama", "1/3 READY")
    line_of(text, "tiny-llama-2", "QUEUED", "102", "in 11m59s", "Resources")
    line_of(text, "tiny-llama-2", "QUEUED: submitted")
    assert "STARTING" not in text and "tiny-llama-1   state" not in text


def test_notes_replace_what_is_missing() -> None:
    ov = recorded()
    text = render(ov, Screen(traffic_note="http://127.0.0.1:8000/metrics needs an admin key"))
    assert "proxy traffic: http://127.0.0.1:8000/metrics needs an admin key" in text
    assert "proxy traffic: no request answered yet" in render(ov)
    text = render(ov, Screen(stale_note="broker: the xhpc broker is not running"))
    line_of(text, "xhpc top", "broker: the xhpc broker is not running")
    assert "[q] quit" in render(ov) and "[q] quit" not in render(ov, Screen(keys=False))


def test_hostile_names_and_messages_neither_restyle_nor_reach_the_terminal() -> None:
    ov = recorded()
    (dep,) = ov.deployments
    evil = "x\x1b[2J\x1b]0;owned\x07[bold red]y[/]\nz"
    r0 = dep.replicas[0].model_copy(update={"reason": evil})
    event = EventRecord(id=99, at=ov.taken_at, kind="state", message=evil, replica_id="a-0")
    ov = ov.model_copy(
        update={
            "deployments": (dep.model_copy(update={"replicas": (r0,)}),),
            "events": (event,),
        }
    )
    console = Console(record=True, width=200, force_terminal=True)
    console.print(frame(ov, (), Screen(filter="\x1b[31m")))
    shown = console.export_text(styles=True)
    assert "\x1b[2J" not in shown and "\x1b]0" not in shown and "\x07" not in shown
    text = render(ov)
    assert text.count("x?[2J?]0;owned?[bold red]y[/]?z") == 2  # the reason and the event


def test_spans_read_as_people_write_them() -> None:
    seconds = (-5, 0, 59, 61, 3599, 3600, 3 * 3600 + 4 * 60, 2 * 86400 + 3 * 3600)
    assert [span(s) for s in seconds] == [
        "0s", "0s", "59s", "1m01s", "59m59s", "1h00m", "3h04m", "2d03h",
    ]  # fmt: skip


def test_keys_filter_clear_and_quit() -> None:
    screen = Screen()
    assert on_keys(screen, "q") is None
    typing = on_keys(screen, "/")
    assert typing == replace(screen, typing=True)
    typed = on_keys(typing, "qwex\x7fn\r")  # q is text while typing; backspace; Enter keeps it
    assert typed == replace(screen, filter="qwen")
    assert on_keys(typed, "\x1b") == screen  # Esc clears
    assert on_keys(on_keys(typed, "f") or screen, "abc\x1b") == screen  # Esc while typing too
    assert on_keys(typed, "\x1b[A") == typed  # an arrow key: ignored, not Esc
    assert on_keys(typed, "zq") is None  # q after other keys still quits
    long = on_keys(typing, "m" * 100)
    assert long is not None and len(long.filter) == 64


def test_an_autoscaled_deployment_shows_its_policy_and_sleep() -> None:
    ov = recorded()
    (dep,) = [d for d in ov.deployments if d.name == "tiny-llama"]
    policy = ScalingPolicy(min_replicas=0, max_replicas=4)
    scaled = dep.model_copy(update={"scaling": policy})
    text = render(ov.model_copy(update={"deployments": (scaled,)}))
    line_of(text, "tiny-llama", "1/3 READY", "restart=always, auto 0..4")
    asleep = scaled.model_copy(update={"wanted": 0, "replicas": ()})
    text = render(ov.model_copy(update={"deployments": (asleep,)}))
    line_of(text, "tiny-llama", "0/0 READY", "auto 0..4, asleep")
