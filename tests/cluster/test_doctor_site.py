"""`xhpc doctor --site` on the real dev cluster: every check ok but NVML (the nodes' GPUs are
fake), through a running broker's agent port; then, with no broker and a vLLM environment that
does not exist, that check's fail line and exit 1, the others still ok."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import XHPC, Xhpc, squeue_ids

pytestmark = [pytest.mark.cluster, pytest.mark.engine]  # it checks the vLLM environment too

# The engine checks import vllm and transformers for real: on two cores that takes a while.
ARGS = ("doctor", "--site", "--json", "--timeout", "240", "--job-timeout", "180")


def _verdicts(out: str) -> dict[str, tuple[str, str]]:
    return {row["name"]: (row["verdict"], row["detail"]) for row in json.loads(out)}


def test_the_dev_cluster_is_ok_but_for_nvml(xhpc_placeholder: Xhpc) -> None:
    proc = xhpc_placeholder.run(*ARGS, check=False, timeout=400)
    rows = _verdicts(proc.stdout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert {n for n, (v, _) in rows.items() if v != "ok"} == {"nvml"}, rows
    assert rows["nvml"][1].startswith("no NVML on node n"), rows["nvml"]
    assert "(fake GPUs?)" in rows["nvml"][1]
    assert "the broker's agent API" in rows["agent-port"][1]
    assert {"slurm", "gres", "partition", "accounting", "state-dir", "clock"} <= set(rows)
    assert not squeue_ids("xhpc-doctor"), "the node job is left in squeue"


def test_a_missing_vllm_env_fails_that_line_and_exits_1(xhpc_placeholder: Xhpc) -> None:
    state = Path(tempfile.mkdtemp(prefix="xt-doctor-", dir="/tmp"))  # no broker here
    try:
        user = state / "user.toml"
        user.write_text('[engines.vllm]\npython = "/nonexistent/vllm/bin/python"\n')
        env = {**xhpc_placeholder.env, "XHPC_STATE_DIR": str(state), "XHPC_USER_CONFIG": str(user)}
        proc = subprocess.run(
            [XHPC, *ARGS], env=env, capture_output=True, text=True, timeout=400, check=False
        )
        rows = _verdicts(proc.stdout)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert {n for n, (v, _) in rows.items() if v == "fail"} == {"engine:vllm"}, rows
        assert "/nonexistent/vllm/bin/python does not exist" in rows["engine:vllm"][1]
        assert "no broker running" in rows["agent-port"][1]
        assert rows["agent-port"][0] == rows["state-dir"][0] == rows["clock"][0] == "ok", rows
    finally:
        shutil.rmtree(state, ignore_errors=True)
