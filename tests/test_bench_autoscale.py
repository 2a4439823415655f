"""bench/autoscale.py's pure parts, without a cluster: the trace, the arrivals, GPU-seconds,
and the targets and table from recorded calls; and a short day end to end on the dev cluster
(the full run: `.venv/bin/python bench/autoscale.py --json FILE`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import autoscale as a
from tests.conftest import ROOT, slurm_env


def test_the_day_and_its_arrivals() -> None:
    assert a.rate_at(10) == 0.0 and a.rate_at(200) == 1.4 and a.rate_at(280) == 0.3
    assert abs(a.rate_at(143) - 0.8) < 1e-9  # halfway up the morning ramp
    assert a.rate_at(20, scale=0.5) == 0.0 and a.rate_at(100, scale=0.5) == 1.4
    plan = a.arrivals(7)
    assert plan == a.arrivals(7) != a.arrivals(8)  # seeded
    assert plan == sorted(plan) and plan[0] > 0 and plan[-1] < a.DAY[-1][0]
    assert not [t for t in plan if t < 120 or t > 405]  # nothing at night
    peak = len([t for t in plan if 165 <= t < 225]) / 60
    assert 1.0 < peak < 1.8  # about 1.4 a second


def test_gpu_seconds_hold_each_sample_until_the_next() -> None:
    assert a.gpu_seconds([(0.0, 3), (10.0, 3)], 20.0) == 60.0
    assert a.gpu_seconds([(0.0, 1), (5.0, 0), (10.0, 2)], 12.0) == 9.0
    assert a.gpu_seconds([], 10.0) == 0.0


def _call(contender: str, ttft: float, held: bool = False, estimate: float | None = None,
          error: str = "", ready: float = float("nan")) -> dict[str, Any]:  # fmt: skip
    return {"contender": contender, "at": 1.0, "sent": 1.0, "ttft": ttft, "took": 2.0,
            "held": held, "estimate_s": estimate, "error": error, "ready_s": ready}  # fmt: skip


def _data(auto_calls: list[dict[str, Any]], auto_gpu: float) -> dict[str, Any]:
    calls = [_call("fixed at peak", 0.1 + i / 1000) for i in range(100)]
    calls += [_call("fixed at 1", 3.0) for _ in range(100)]
    calls += auto_calls
    return {
        "calls": calls,
        "gpu_seconds": {"fixed at peak": 1000.0, "fixed at 1": 333.0, "xhpc": auto_gpu},
    }


def test_targets_met_and_the_table() -> None:
    auto = [_call("xhpc", 0.1 + i / 1000) for i in range(99)]
    auto.append(_call("xhpc", 11.0, held=True, estimate=8.0, ready=9.0))
    data = _data(auto, 450.0)
    found = a.targets(data)
    assert [t["target"] for t in found] == [a.TARGET_GPU, a.TARGET_TTFT, a.TARGET_FAILED,
                                            a.TARGET_HELD]  # fmt: skip
    assert [t["met"] for t in found] == [True, True, True, True], found
    assert found[0]["value"].startswith("0.45x") and "1 of 1 answered" in found[3]["value"]
    data["targets"] = found
    text = a.table(data)
    assert "| GPU-seconds | 1000 | 333 | 450 | 0.45x |" in text
    assert "| held: wait for a replica / estimate (s) | | | 9.0/8 | |" in text
    assert "| held: TTFT (s) | | | 11.0 | |" in text
    assert f"MET  {a.TARGET_HELD}" in text


def test_a_late_wake_a_failure_slow_answers_or_nothing_held_are_not_met() -> None:
    auto = [_call("xhpc", 2.0) for _ in range(50)]
    auto.append(_call("xhpc", 11.0, held=True, estimate=8.0, ready=10.5))  # 1.31x its estimate
    auto.append(_call("xhpc", float("nan"), error="HTTP 503"))
    found = {t["target"]: t for t in a.targets(_data(auto, 700.0))}
    assert not found[a.TARGET_GPU]["met"] and not found[a.TARGET_TTFT]["met"]
    assert not found[a.TARGET_FAILED]["met"] and found[a.TARGET_FAILED]["value"] == "1 of 52"
    assert not found[a.TARGET_HELD]["met"]
    none_held = {t["target"]: t for t in a.targets(_data([_call("xhpc", 0.1)], 100.0))}
    assert not none_held[a.TARGET_HELD]["met"]  # a wake not measured is not met
    unseen = [_call("xhpc", 0.1), _call("xhpc", 5.0, held=True, estimate=8.0)]  # no last comment
    assert not {t["target"]: t for t in a.targets(_data(unseen, 100.0))}[a.TARGET_HELD]["met"]
    assert not {t["target"]: t for t in a.targets({"calls": []})}[a.TARGET_FAILED]["met"]


@pytest.mark.cluster
def test_a_short_day_on_the_dev_cluster_answers_every_call(
    dev_cluster: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The benchmark end to end at a seventh of its day (about 100 s; the Slurm tier: the echo
    engine, no vLLM): its table has the three contenders, its JSON the four targets, and no
    call failed, the held ones included. Its speed figures are not asserted (a day this short
    leaves the policy no time: docs/performance.md has the full run's)."""
    out = tmp_path / "autoscale.json"
    argv = [sys.executable, str(ROOT / "bench" / "autoscale.py"), "--scale", "0.15",
            "--idle-s", "10", "--down-window-s", "10", "--smooth-s", "5", "--trend-min-s", "10",
            "--start-s", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=slurm_env(), capture_output=True, text=True,
                          timeout=480)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| figure | fixed at peak | fixed at 1 | xhpc | xhpc / at peak |" in proc.stdout
    data = json.loads(out.read_text())
    targets = {t["target"]: t for t in data["targets"]}
    assert len(targets) == 4 and all(isinstance(t["met"], bool) for t in targets.values())
    assert targets["0 failed calls (xhpc)"]["met"], targets
    calls = data["calls"]
    assert {c["contender"] for c in calls} == {"fixed at peak", "fixed at 1", "xhpc"}
    assert [c for c in calls if c["error"]] == []
    held = [c for c in calls if c["contender"] == "xhpc" and c["held"]]
    assert held, "the night's first call found it asleep: held"
