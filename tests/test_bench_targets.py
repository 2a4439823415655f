"""The CLI and placement benchmarks run, print their table and write their figures with one
`targets` entry per target they check (small sizes: this is about the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, tmp_path: Path) -> tuple[str, dict[str, object]]:
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())


def check_targets(data: dict[str, object], expected: int) -> None:
    targets = data["targets"]
    assert isinstance(targets, list) and len(targets) == expected
    for t in targets:
        assert set(t) == {"target", "value", "met"} and isinstance(t["met"], bool), t


def test_the_cli_benchmark(tmp_path: Path) -> None:
    table, data = run_bench("cli.py", "--rounds", "1", tmp_path=tmp_path)
    assert "| xhpc --help |" in table and "| xhpc ps |" in table
    check_targets(data, 2)


def test_the_placement_benchmark(tmp_path: Path) -> None:
    table, data = run_bench(
        "placement.py", "--sizes", "200", "--decisions", "20", tmp_path=tmp_path
    )
    assert "| 200 x 8" in table
    check_targets(data, 5)  # ingest, then p99 and agreement per strategy
    agreement = [t for t in data["targets"] if "agreement" in t["target"]]  # type: ignore[attr-defined]
    assert len(agreement) == 2 and all(t["met"] for t in agreement), agreement  # not timing
