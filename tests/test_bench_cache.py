"""bench/cache.py's table, targets and round plan from given figures, and its throttle: the
pacer's arithmetic, and (``-m bench``: after scripts/setup-bench) a real mount read at its cap,
skipped where FUSE is not usable. The run itself needs the dev cluster: `bench/cache.py`,
docs/performance.md."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bench._throttle import Pacer, fuse_usable, unmount
from bench.cache import COLD, FIRST, WARM, first_node, order, parse_args, summarize

ROOT = Path(__file__).resolve().parent.parent
FUSE_PYTHON = ROOT / ".venvs" / "mfusepy" / "bin" / "python"
PARAMS = {"mb": 200.0, "cap_mb_s": 20.0, "read_mb_s": 19.6}  # 10 s of reading at the cap


def _round(n: int, cold: float | None, first: float | None, warm: float | None) -> list[Any]:
    def rec(contender: str, seconds: float | None, **extra: Any) -> dict[str, Any]:
        error = "" if seconds is not None else "no READY within 600 s"
        return {"round": n, "contender": contender, "seconds": seconds, "error": error, **extra}

    return [
        rec(COLD, cold, node="n1"),
        rec(FIRST, first, node=first_node(n)),
        rec(WARM, warm, node=first_node(n), on_copy_node=True, reason_ok=True),
    ]


def _met(summary: Any) -> list[bool]:
    targets = summary.data["targets"]
    assert all(set(t) == {"target", "value", "met"} for t in targets)
    return [t["met"] for t in targets]


def test_the_table_shows_each_start_against_cold_and_all_targets_met() -> None:
    records = _round(0, 16.0, 18.0, 6.0) + _round(1, 15.0, 17.0, 5.0) + _round(2, 17.0, 19.5, 6.5)
    summary = summarize(records, PARAMS)
    assert "| cold | 16.00 [15.00, 17.00] | 1.00 [1.00, 1.00]x | 3/3 |" in summary.text
    assert "| staged, warm | 6.00 [5.00, 6.50] | 0.38 [0.33, 0.38]x | 3/3 |" in summary.text
    assert "warm vs cold: 2.67 [2.62, 3.00]x faster, 10.00 [10.00, 10.50] s saved" in summary.text
    assert "reason saying so: 3/3" in summary.text
    assert _met(summary) == [True, True, True, True, True]
    assert summary.data["warm_faster_x"] == [16.0 / 6.0, 3.0, 17.0 / 6.5]


def test_targets_fail_when_warm_saves_little_or_lands_elsewhere() -> None:
    records = _round(0, 16.0, 22.0, 12.0)
    records[2].update(on_copy_node=False, node="n1")
    summary = summarize(records, {**PARAMS, "read_mb_s": 25.0})  # faster than the cap: broken
    # 1.33x, 4 s saved of 10, first 1.375x cold, placed elsewhere, the cap not held
    assert _met(summary) == [False, False, False, False, False]


def test_a_start_that_never_answered_is_listed_and_leaves_its_round_out_of_the_ratios() -> None:
    records = _round(0, 16.0, 18.0, None) + _round(1, 15.0, 17.0, 5.0)
    summary = summarize(records, PARAMS)
    assert "| staged, warm | 5.00 | 0.33x | 1/2 |" in summary.text
    assert "round 0 staged, warm: no READY within 600 s" in summary.text
    assert summary.data["warm_faster_x"] == [3.0]


def test_rounds_alternate_cold_first_and_last_and_stage_off_the_first_node_by_name() -> None:
    assert order(0) == (COLD, FIRST, WARM) and order(1) == (FIRST, WARM, COLD)
    assert [first_node(n) for n in range(4)] == ["n2", "n3", "n2", "n3"]
    quick = parse_args(["--quick"])
    assert (quick.rounds, quick.mb) == (1, 100.0)
    full = parse_args(["--rounds", "5", "--mb", "300", "--cap", "10"])
    assert (full.rounds, full.mb, full.cap) == (5, 300.0, 10.0)


def test_the_pacer_lets_no_more_than_the_cap_through() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)

    pacer = Pacer(1e6, clock=lambda: now[0], sleep=sleep)
    assert pacer.take(500_000) == pytest.approx(0.5)
    assert pacer.take(500_000) == pytest.approx(1.0)  # queued behind the first
    now[0] = 3.0  # idle since: no credit saved up
    assert pacer.take(1_000_000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        Pacer(0)


def _fuse_skip_reason() -> str | None:
    why = fuse_usable()
    if why:
        return why
    if not (FUSE_PYTHON.parent.parent / ".xhpc-setup").exists():  # written once installed
        return f"no mfusepy in {FUSE_PYTHON.parent.parent} (scripts/setup-bench)"
    return None


@pytest.mark.bench  # .venvs/mfusepy (scripts/setup-bench): the full run's last tier, once installed
def test_a_file_read_through_the_mount_pays_the_cap_on_every_open(tmp_path: Path) -> None:
    why = _fuse_skip_reason()
    if why:
        pytest.skip(f"FUSE not usable here: {why}")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    data = os.urandom(4_000_000)
    (src / "w.bin").write_bytes(data)
    proc = subprocess.Popen(
        [str(FUSE_PYTHON), str(ROOT / "bench" / "_throttle.py"), str(src), str(mnt),
         "--mb-s", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"the throttle did not mount (exit {proc.poll()}): {out[-1000:]}")
            time.sleep(0.05)
        for _ in range(2):  # the second open is not served from a cache
            t0 = time.monotonic()
            assert (mnt / "w.bin").read_bytes() == data
            assert time.monotonic() - t0 >= 0.45  # 4 MB at 8 MB/s: never faster than the cap
        with pytest.raises(OSError):
            (mnt / "w.bin").write_bytes(b"x")  # read-only
        proc.terminate()  # SIGTERM by its PID: it unmounts and exits 0
        assert proc.wait(timeout=20) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        unmount(mnt)
