"""bench/continuity.py's pure parts, without a cluster: the fault table and its targets from
recorded figures (bench/_continuity/table.py), the figures from recorded samples (out of
rotation, capacity restored, the proxy's first failed connect: bench/_continuity/figures.py),
and the command line (``--help``, ``--only``, ``--short``).

The benchmark itself runs on the dev cluster (`.venv/bin/python bench/continuity.py`); nothing
here starts a broker, a proxy or a job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from bench import continuity
from bench._continuity import figures, params, table
from tests.cluster.traffic import Outcome

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "continuity.py"


def _rec(scenario: str, **given: Any) -> dict[str, Any]:
    """A scenario's figures as the benchmark records them, everything fine by default."""
    rec: dict[str, Any] = {
        "scenario": scenario,
        "error": None,
        "notes": [],
        "sent": {"plain": 40, "stream": 40},
        "failed": {"plain": 0, "stream": 0},
        "truncated": 0,
        "samples": 500,
        "victim": None,
        "dropped": False,
        "restored_s": None,
        "jobs_needed": 2,
        "extra_jobs": 0,
        "leaked_jobs": 0,
    }
    per: dict[str, dict[str, Any]] = {
        "engine-kill": {"victim": "c1-0", "out_of_rotation_s": 1.2, "dropped": True,
                        "restored_s": 14.0, "jobs_needed": 3},
        "requeue": {"victim": "c1-0", "out_of_rotation_s": 0.6, "dropped": True,
                    "restored_s": 70.0, "left_running_s": 0.2, "failed_after_left_running": 0},
        "proxy-worker-kill": {"failed": {"plain": 1, "stream": 1},
                              "in_flight_at_killed_worker": 2, "failed_after_kill": 0},
        "proxy-reload": {"reload_s": 1.9},
        "broker-kill": {"broker_down_s": 30.0, "relaunches": 0, "duplicate_jobs": 0,
                        "lost_transitions": 0},
        "preemption": {"victim": "c1-0", "out_of_rotation_s": 2.0, "dropped": True,
                       "restored_s": 130.0, "jobs_needed": 3},
        "node-loss": {"victim": "c1-0", "out_of_rotation_s": 4.0, "dropped": True,
                      "restored_s": 140.0, "first_failed_connect_s": 0.3,
                      "first_failed_connect_from": "the proxy's log",
                      "out_of_rotation_after_connect_s": 3.7, "failed": {"plain": 0, "stream": 1},
                      "jobs_needed": 3, "replacement_start_s": 137.0,
                      "replacement_submitted_s": 1.5},
        "ctld-outage": {"transitions_during_outage": 0},
        "walltime": {"handovers": 2, "successors": 2, "jobs_needed": 3},
        "crash-loop": {"victim": "c1-0", "out_of_rotation_s": 0.4, "dropped": True,
                       "restored_s": None, "attempts": 2, "deployment_failed": True,
                       "jobs_needed": 3},
    }  # fmt: skip
    rec.update(per[scenario])
    if scenario == "crash-loop":  # no traffic
        for key in ("sent", "failed", "truncated"):
            rec.pop(key)
    rec.update(given)
    return rec


def _all(**changes: dict[str, Any]) -> list[dict[str, Any]]:
    return [_rec(name, **changes.get(name.replace("-", "_"), {})) for name in params.NAMES]


def _targets(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["target"]: t for t in table.evaluate_targets(records)}


def _find(targets: dict[str, dict[str, Any]], start: str) -> dict[str, Any]:
    (hit,) = [t for name, t in targets.items() if name.startswith(start)]
    return hit


def test_one_row_per_scenario_and_every_target_met() -> None:
    records = _all()
    summary = table.summarize(records, {"broker_down_s": 30.0})
    lines = summary.text.splitlines()
    body = lines[lines.index(table.HEADER) + 2 : lines.index("### Targets")]
    for name, label in params.SCENARIOS:
        rows = [ln for ln in body if ln.startswith(f"| {label}")]
        assert len(rows) == 1, (name, summary.text)
        assert rows[0].count("|") == table.HEADER.count("|"), rows[0]
    row = {r["scenario"]: table.row(r) for r in records}
    assert row["engine-kill"].startswith(
        "| engine SIGKILL | 40 / 40 | 0 / 0 | 0 | 1.2 | 14.0 | 0 | 0 |"
    )
    assert "| broker kill -9, down 30 s | 40 / 40 |" in row["broker-kill"]
    assert "| — | no drop |" in row["proxy-reload"]  # no replica hit, none lost
    assert "| 4.0 (3.7 after the first failed connect) |" in row["node-loss"]
    assert row["crash-loop"].startswith("| crash loop | — | — | — | 0.4 | not restored |")

    targets = summary.data["targets"]
    assert len(targets) == 11
    assert all(set(t) == {"target", "value", "met"} for t in targets)
    assert [t for t in targets if not t["met"]] == []
    assert "Not run" not in summary.text
    json.dumps(summary.data)  # what --json writes


def test_each_target_fails_on_its_own_figure() -> None:
    cases: dict[str, dict[str, Any]] = {
        "walltime boundary": {"walltime": {"failed": {"plain": 0, "stream": 1}}},
        "proxy worker kill": {"proxy_worker_kill": {"failed": {"plain": 2, "stream": 1}}},
        "proxy reload": {"proxy_reload": {"failed": {"plain": 1, "stream": 0}}},
        "no truncated": {"requeue": {"truncated": 1}},
        "broker kill": {"broker_kill": {"relaunches": 1}},
        "requeue": {"requeue": {"failed_after_left_running": 1}},
        "node loss: out of rotation": {"node_loss": {"out_of_rotation_s": 9.0}},
        "node loss: 0 plain": {"node_loss": {"failed": {"plain": 1, "stream": 0}}},
        "node loss: replacement": {"node_loss": {"replacement_start_s": 134.0}},
        "slurmctld": {"ctld_outage": {"transitions_during_outage": 2}},
        "crash loop": {"crash_loop": {"attempts": 4}},
    }
    for start, change in cases.items():
        targets = _targets(_all(**change))
        missed = [name for name, t in targets.items() if not t["met"]]
        assert len(missed) == 1 and missed[0].lower().startswith(start), (start, missed)
    # a worker kill whose failures include one sent after the kill
    targets = _targets(_all(proxy_worker_kill={"failed_after_kill": 1}))
    assert not _find(targets, "proxy worker kill")["met"]
    # two handovers are part of the walltime figure
    assert not _find(_targets(_all(walltime={"handovers": 1})), "walltime")["met"]
    # duplicate jobs after a broker outage
    assert not _find(_targets(_all(broker_kill={"duplicate_jobs": 1})), "broker")["met"]
    # a crash loop that never ends in FAILED
    assert not _find(_targets(_all(crash_loop={"deployment_failed": False})), "crash")["met"]


def test_node_loss_without_an_observed_failed_connect_is_judged_on_the_raw_figure() -> None:
    change = {"first_failed_connect_s": None, "out_of_rotation_after_connect_s": None}
    target = _find(_targets(_all(node_loss={**change, "out_of_rotation_s": 4.5})), "node loss: out")
    assert target["met"] and "raw" in target["value"]
    target = _find(_targets(_all(node_loss={**change, "out_of_rotation_s": 6.0})), "node loss: out")
    assert not target["met"] and "6.0 s after the fault" in target["value"]
    # observed: the time before the first failed connect is not counted
    target = _find(
        _targets(_all(node_loss={"out_of_rotation_s": 7.0, "first_failed_connect_s": 2.5})),
        "node loss: out",
    )
    assert target["met"] and target["value"].startswith("4.5 s")
    target = _find(_targets(_all(node_loss={"out_of_rotation_s": None})), "node loss: out")
    assert not target["met"]


def test_a_failed_scenario_meets_none_of_its_targets_and_says_why() -> None:
    records = _all(requeue={"error": "AssertionError: timed out after 180s waiting for X"})
    targets = _targets(records)
    requeue = _find(targets, "requeue")
    assert not requeue["met"] and "scenario failed: AssertionError" in requeue["value"]
    assert [name for name, t in targets.items() if not t["met"]] == [requeue["target"]]
    row = table.row(next(r for r in records if r["scenario"] == "requeue"))
    assert "ERROR: AssertionError: timed out" in row


def test_scenarios_not_run_have_no_target() -> None:
    records = [_rec("engine-kill"), _rec("requeue")]
    summary = table.summarize(records, {"broker_down_s": 30.0})
    names = [t["target"] for t in summary.data["targets"]]
    assert len(names) == 2  # no truncated 200, requeue
    assert names[0].startswith("no truncated") and names[1].startswith("requeue")
    assert "Not run: proxy-worker-kill, proxy-reload, broker-kill" in summary.text
    # a run without a scenario that sends traffic has no truncation target either
    assert table.evaluate_targets([_rec("crash-loop")])[0]["target"].startswith("crash loop")


def test_rows_for_a_scenario_that_stopped_before_its_fault() -> None:
    rec = {"scenario": "node-loss", "error": "start: AssertionError: broker socket", "notes": []}
    row = table.row(rec)
    assert row.startswith("| node loss (node-fail) | — | — | — | — | — | — | — | ERROR: start")
    targets = _targets([rec])
    # its own targets are not met; the truncation target counts the requests that were sent
    assert [t["met"] for t in targets.values()] == [True, False, False, False]
    assert _find(targets, "no truncated")["value"] == "0 in 1 scenario(s)"


def _s(t: float, routed: tuple[str, ...] | None, ready: int | None) -> Any:
    return figures.Sample(t, None if routed is None else frozenset(routed), ready)


def test_out_of_rotation_and_capacity_from_samples() -> None:
    samples = [
        _s(9.8, ("a", "b"), 2),
        _s(10.0, ("a", "b"), 2),  # the fault at 10.0: this sample still routes a
        _s(10.2, None, None),  # the broker did not answer
        _s(10.4, ("b",), 2),
        _s(10.6, ("b",), 1),
        _s(30.0, ("b",), 1),
        _s(30.2, ("b", "c"), 2),
    ]
    assert figures.out_of_rotation(samples, "a", 10.0) == pytest.approx(0.4)
    assert figures.out_of_rotation(samples, "b", 10.0) is None
    dropped, back = figures.restored(samples, 2, 10.0)
    assert dropped and back == pytest.approx(20.2)
    assert figures.restored(samples[:6], 2, 10.0) == (True, None)  # not back yet
    assert figures.restored(samples[:4], 2, 10.0) == (False, None)  # never fewer
    gap = [_s(0, ("a",), 1), _s(1, (), 1), _s(2, (), 1), _s(3, ("b",), 1), _s(4, (), 1)]
    assert figures.route_gap(gap, 0.0) == pytest.approx(2.0)
    assert figures.route_gap(gap, 3.5) == 0.0


def test_first_failed_connect_from_the_proxy_log() -> None:
    def stamp(epoch: float) -> str:
        dt = datetime.fromtimestamp(epoch)
        return dt.strftime("%Y-%m-%d %H:%M:%S,") + f"{dt.microsecond // 1000:03d}"

    fault = 1_800_000_000.25
    text = "\n".join(
        [
            f"{stamp(fault - 5)} xhpc.proxy.forward WARNING replica r-0 unreachable: "
            "ClientConnectorError",  # before the fault
            f"{stamp(fault + 0.5)} xhpc.proxy.forward WARNING replica r-0 unreachable: "
            "ServerDisconnectedError",  # a dropped request, not a failed connect
            f"{stamp(fault + 0.7)} xhpc.proxy.forward WARNING replica r-1 unreachable: "
            "ClientConnectorError",  # another replica
            f"{stamp(fault + 0.9)} xhpc.proxy.forward WARNING replica r-0 unreachable: "
            "UpstreamConnectError",
            f"{stamp(fault + 1.5)} xhpc.proxy.forward WARNING connecting to replica r-0 timed out",
        ]
    )
    at = figures.first_failed_connect(text, "r-0", fault)
    assert at is not None and at - fault == pytest.approx(0.9, abs=0.002)
    timed_out = text.splitlines()[-1]
    at = figures.first_failed_connect(timed_out, "r-0", fault)
    assert at is not None and at - fault == pytest.approx(1.5, abs=0.002)
    assert figures.first_failed_connect(text, "r-2", fault) is None


def test_traffic_figures_count_plain_and_streams_apart() -> None:
    t = time.monotonic()
    outcomes = [
        Outcome(t, False, True, 200),
        Outcome(t + 1, True, True, 200),
        Outcome(t + 2, False, False, 503, "no_ready_replica"),
        Outcome(t + 3, True, False, 200, "error event: {}"),
        Outcome(t + 4, True, False, 200, "stream cut short", truncated=True),
    ]
    got = figures.traffic_figures(outcomes, t + 2.5)
    assert got["sent"] == {"plain": 2, "stream": 3}
    assert got["failed"] == {"plain": 1, "stream": 2}
    assert got["truncated"] == 1
    assert [f["at_s"] for f in got["failures"]] == [-0.5, 0.5, 1.5]


def test_command_line() -> None:
    assert continuity.parse_args([]).scenarios == list(params.NAMES)
    assert continuity.parse_args(["--short"]).scenarios == ["engine-kill", "requeue"]
    only = continuity.parse_args(["--only", "requeue,engine-kill", "--broker-down-s", "300"])
    assert only.scenarios == ["engine-kill", "requeue"] and only.broker_down_s == 300.0
    with pytest.raises(SystemExit):
        continuity.parse_args(["--only", "requeue,nope"])
    # --help works without the cluster, and lists every scenario
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for name in params.NAMES:
        assert name in proc.stdout
    bad = subprocess.run(
        [sys.executable, str(BENCH), "--only", "nope"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown scenario(s) nope" in bad.stderr


def test_a_log_line_s_time_is_read_as_local_time() -> None:
    text = (
        "2026-12-01 11:52:01,511 xhpc.store.store INFO transition replica=a-0 to=QUEUED job=11\n"
        "2026-12-01 11:52:23,251 xhpc.store.store INFO transition replica=a-0 to=READY job=11 x\n"
    )
    at = figures.logged_at(text, "to=READY job=11 ")
    assert at == datetime(2026, 12, 1, 11, 52, 23, 251000).timestamp()
    assert figures.logged_at(text, "to=READY job=1 ") is None
