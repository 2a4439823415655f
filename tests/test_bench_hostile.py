"""bench/hostile.py's pure parts, without a cluster: the table and its targets from recorded
rounds, the percentiles and counts of one round, the 64 MiB input's shape (exact size, a valid
batch input), the hostile calls' classes and the command line; then, on the dev cluster, a
``--quick`` run whose JSON has the three targets (met or not: a test does not time things)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench._hostile.measure import NO_ANSWER, Samples, percentile
from bench._hostile.table import summarize
from bench._hostile.tenants import request_line, status_class, write_big
from bench.hostile import parse_args

ROOT = Path(__file__).resolve().parent.parent


def _round(kind: str, n: int, chat_p99: float, health_p99: float, **extra: Any) -> dict[str, Any]:
    def stream(p99: float) -> dict[str, Any]:
        return {"p50": p99 / 4, "p99": p99, "done": 100, "errors": 0, "server_errors": 0,
                "statuses": {"200": 100}}  # fmt: skip

    rec = {"kind": kind, "round": n, "chat": stream(chat_p99), "health": stream(health_p99)}
    if kind == "hostile":
        ops = {"upload 64 MiB": {"200": 2}, "create batch": {"200": 30, "429": 5}}
        rec["tenants"] = {"seconds": 10.0, "cpu_s": 1.0, "uploaded_bytes": 2 * (64 << 20),
                          "ops": ops}  # fmt: skip
    rec.update(extra)
    return rec


def test_the_table_sets_each_hostile_round_against_the_quiet_one_before_it() -> None:
    rounds = [
        _round("quiet", 0, 0.010, 0.004), _round("hostile", 0, 0.015, 0.004),
        _round("quiet", 1, 0.020, 0.002), _round("hostile", 1, 0.020, 0.010),
        _round("quiet", 2, 0.010, 0.004), _round("hostile", 2, 0.030, 0.006),
    ]  # fmt: skip
    summary = summarize(rounds, {"rounds": 3})
    text, data = summary.text, summary.data
    # chat p99 ratios 1.5, 1.0, 3.0 -> 1.50x [1.00, 3.00]; health 1.0, 5.0, 1.5 -> 1.50x
    assert "| quiet | 3 | 2.5 [2.5, 5.0] | 10.0 [10.0, 20.0] |" in text
    assert "| 1.50x [1.00, 3.00] | 1.50x [1.00, 5.00] | 300 / 300 | 0 / 0 |" in text
    assert data["ratios"]["chat_p99"] == pytest.approx([1.5, 1.0, 3.0])
    assert [t["met"] for t in data["targets"]] == [True, True, True]
    assert [t["target"] for t in data["targets"]] == [
        "chat p99 under hostile load <= 2x quiet",
        "broker health p99 under hostile load <= 2x quiet",
        "no 5xx for the third key and the broker",
    ]
    assert all(set(t) == {"target", "value", "met"} for t in data["targets"])
    # The hostile keys' answers, per call, summed over the hostile rounds (429s apart).
    assert "| create batch | 90 | 15 | 0 | 0 | 0 |" in text
    assert "uploaded 384 MiB of 64 MiB files (12.8 MiB/s)" in text


def test_a_slow_round_or_a_5xx_misses_its_target() -> None:
    rounds = [_round("quiet", 0, 0.010, 0.002), _round("hostile", 0, 0.025, 0.003)]
    rounds[0]["health"].update(server_errors=1, errors=1)
    data = summarize(rounds, {}).data
    assert [t["met"] for t in data["targets"]] == [False, True, False]
    assert data["targets"][0]["value"] == "2.50x" and data["targets"][2]["value"] == "1"
    # Nothing measured (every request failed): no ratio, not met.
    rounds[1]["chat"]["p99"] = float("nan")
    assert summarize(rounds, {}).data["targets"][0] == {
        "target": "chat p99 under hostile load <= 2x quiet", "value": "n/a", "met": False,
    }  # fmt: skip


def test_a_round_keeps_the_percentiles_of_its_200s_and_counts_the_rest() -> None:
    assert percentile([], 0.99) != percentile([], 0.99)  # NaN
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([float(i) for i in range(1, 201)], 0.99) == 198.0
    samples = Samples()
    for latency in (0.001, 0.002, 0.003):
        samples.note(200, latency)
    samples.note(429, 0.5)
    samples.note(502, 0.5)
    samples.note(NO_ANSWER, 30.0)
    figures = samples.figures()
    assert figures["p50"] == 0.002 and figures["p99"] == 0.003
    assert (figures["done"], figures["errors"], figures["server_errors"]) == (5, 3, 2)


def test_the_big_input_is_exactly_its_size_in_valid_request_lines(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    assert write_big(path, 64 * 1024, 1024, "bench-echo") == 64
    data = path.read_bytes()
    assert len(data) == 64 * 1024
    lines = data.splitlines(keepends=True)
    assert len(lines) == 64 and all(len(line) == 1024 for line in lines)
    parsed = [json.loads(line) for line in lines]
    assert len({p["custom_id"] for p in parsed}) == 64
    assert {p["body"]["model"] for p in parsed} == {"bench-echo"}
    with pytest.raises(ValueError):
        write_big(path, 1000, 1024, "m")
    with pytest.raises(ValueError):
        write_big(path, 64, 64, "m")  # too short for a request line
    assert json.loads(request_line("a", "m", "hi"))["url"] == "/v1/chat/completions"


def test_hostile_answers_are_classed_and_quick_is_short() -> None:
    classes = [status_class(s) for s in (200, 429, 400, 404, 413, 500, 503, 0)]
    assert classes == ["200", "429", "4xx", "4xx", "4xx", "5xx", "5xx", "failed"]
    quick, full = parse_args(["--quick"]), parse_args([])
    assert (quick.rounds, quick.round_s) == (2, 6.0)
    assert (full.rounds, full.round_s) == (5, 20.0)
    assert parse_args(["--quick", "--rounds", "3"]).rounds == 3


@pytest.mark.bench
@pytest.mark.cluster
def test_a_quick_run_writes_the_three_targets(dev_cluster: Path, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hostile.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=420, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| quiet | 2 |" in done.stdout and "| hostile | 2 |" in done.stdout
    data = json.loads(out.read_text())
    targets = data["targets"]
    assert len(targets) == 3
    for t in targets:
        assert set(t) == {"target", "value", "met"} and isinstance(t["met"], bool), t
    assert [r["kind"] for r in data["rounds"]] == ["quiet", "hostile"] * 2
    # The tenants ran: the big file went up at least once, and the flood created batches.
    assert data["tenants"]["uploaded_mib"] >= 64
    assert data["tenants"]["ops"]["create batch"]["200"] >= 1
