"""bench/pd.py --short runs end to end against a real vLLM CPU prefill/decode pair (NIXL): the
table lists both contenders (xhpc's PD route and vLLM's toy PD proxy), every prompt got the same
output through both and from a plain single instance, and the decode instance's
external-KV-transfer counter grew during every run of both contenders.

Needs .venvs/vllm (scripts/setup-engines vllm) and vLLM's toy proxy extracted from its sdist
(.venvs/vllm-toy-proxy/toy_proxy_server.py, scripts/setup-bench); skipped, saying which, without
them. Marked `engine` (three real engines, ~2 min): deselect with `-m "not engine"`. It asserts no
speed (NIXL busy-polls on CPU): the figures are for docs/performance.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "pd.py"
VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"
TOY_PROXY = ROOT / ".venvs" / "vllm-toy-proxy" / "toy_proxy_server.py"
CONTENDERS = ["vLLM toy proxy", "xhpc proxy"]
WORKLOADS = ["c1", "c1-sse", "c4", "c4-sse"]

pytestmark = pytest.mark.engine


def _missing() -> list[str]:
    missing = []
    if not VLLM_PY.exists():
        missing.append(f"{VLLM_PY} (scripts/setup-engines vllm)")
    if not TOY_PROXY.exists():
        missing.append(f"vLLM's toy PD proxy {TOY_PROXY} (scripts/setup-bench)")
    return missing


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Like subprocess.run, but on a timeout the benchmark gets SIGTERM first, so that it stops
    the engines and proxies it started (they also die with it if it is killed)."""
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
            pytest.fail(f"bench/pd.py timed out after {timeout:.0f}s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_bench_pd_short(tmp_path: Path) -> None:
    missing = _missing()
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    out = tmp_path / "pd.json"
    proc = _run([sys.executable, str(BENCH), "--short", "--json", str(out)], timeout=540)
    assert proc.returncode == 0, f"bench/pd.py failed:\n{proc.stderr[-4000:]}"
    table = proc.stdout
    for name in CONTENDERS:
        rows = [ln for ln in table.splitlines() if ln.startswith(f"| {name} |")]
        # a latency row per workload and the correctness/KV row
        assert len(rows) == len(WORKLOADS) + 1, f"{name}: expected 5 rows:\n{table}"

    data = json.loads(out.read_text())
    assert data["contenders"] == CONTENDERS
    assert data["mismatches"] == [], data["mismatches"]
    for name in CONTENDERS:
        c = data["correctness"][name]
        assert c["requests"] > 0 and c["errors"] == 0, (name, c)
        # the same output through both proxies and from a single instance, for every prompt
        assert c["match_other"] == c["requests"], (name, c)
        assert c["match_single_instance"] == c["requests"], (name, c)
        # the KV really moved: the decode instance took prompt tokens from the transfer in
        # every run of this contender
        assert c["kv_tokens"] > 0, (name, c)
        assert c["runs_kv_moved"] == c["runs"], (name, c)
        assert set(data["latency"][name]) == set(WORKLOADS)
    # xhpc's route handed P's kv_transfer_params to D on every measured request
    requests = data["correctness"]["xhpc proxy"]["requests"]
    assert data["xhpc_handoffs"]["true"] == requests, data["xhpc_handoffs"]
    assert data["xhpc_handoffs"]["false"] == 0, data["xhpc_handoffs"]
