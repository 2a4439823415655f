"""bench/routing.py --short runs end to end against real vLLM CPU engines: the table lists both
policies, affinity kept every session on one replica (and round robin did not), no request
failed, and the engines' prefix caches were used.

Needs .venvs/vllm (scripts/setup-engines vllm); skipped without it. Marked `engine` (two real
engines, ~1 min): deselect with `-m "not engine"`. It asserts no speed: the figures are for
docs/performance.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "routing.py"
VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"

pytestmark = pytest.mark.engine


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Like subprocess.run, but on a timeout the benchmark gets SIGTERM first, so that it stops
    the engines it started (they also die with it if it is killed)."""
    with subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"bench/routing.py timed out after {timeout:.0f}s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_bench_routing_short(tmp_path: Path) -> None:
    if not VLLM_PY.exists():
        pytest.skip(f"no {VLLM_PY}: run scripts/setup-engines vllm")
    out = tmp_path / "routing.json"
    proc = _run([sys.executable, str(BENCH), "--short", "--json", str(out)], timeout=600)
    assert proc.returncode == 0, f"bench/routing.py failed:\n{proc.stderr[-4000:]}"
    table = proc.stdout
    for label in ("affinity", "round robin"):
        rows = [ln for ln in table.splitlines() if ln.startswith("| ") and f"| {label} |" in ln]
        assert len(rows) == 1, f"{label}: expected one row:\n{table}"
    assert "| p50 affinity / RR | p90 affinity / RR |" in table, table

    data = json.loads(out.read_text())
    runs = {r["policy"]: r for r in data["runs"]}
    assert set(runs) == {"affinity", "round robin"}, runs.keys()
    params = data["params"]
    requests = params["sessions"] * params["turns"]
    for run in runs.values():
        assert run["errors"] == [], run["errors"]
        assert len(run["ttfts"]) == requests
        assert len(run["replicas_of"]) == params["sessions"]
        assert set(run["per_replica"]) <= {f"r{i}" for i in range(params["replicas"])}
        assert run["queries"] > 0  # the engines' prefix-cache counters moved
    # Affinity: every turn of a session on one replica (its prompt prefix is the key).
    for session, replicas in runs["affinity"]["replicas_of"].items():
        assert len(set(replicas)) == 1, (session, replicas)
    # Round robin: requests alternate, so sessions are spread over the replicas.
    assert len(runs["round robin"]["per_replica"]) == params["replicas"]
    assert any(len(set(rs)) > 1 for rs in runs["round robin"]["replicas_of"].values())
    # The same prompts reach a replica that has them cached more often under affinity.
    hit = {p: r["hits"] / r["queries"] for p, r in runs.items()}
    assert hit["affinity"] > hit["round robin"], hit
