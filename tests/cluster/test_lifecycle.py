"""Replica lifecycle on the real cluster: Slurm's pending reason, and the time-limit signal."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import Xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


def _replica(x: Xhpc, replica_id: str) -> dict[str, object]:
    rows = [r for r in x.json("ps", "--all") if r["replica_id"] == replica_id]
    assert len(rows) == 1
    return rows[0]


def test_queued_replica_shows_slurms_pending_reason(xhpc: Xhpc, unique_name: str) -> None:
    # The first deployment takes all four GPUs of n2; the second, pinned there too, must wait.
    first = xhpc.json(
        "serve",
        "tiny-llama",
        "--name",
        f"{unique_name}a",
        "--gpus",
        "4",
        "--nodelist",
        "n2",
        "--timeout",
        "240",
    )
    assert first["replicas"][0]["state"] == "READY"
    assert first["replicas"][0]["gpus"] == [0, 1, 2, 3]
    second = xhpc.json(
        "serve",
        "tiny-llama",
        "--name",
        f"{unique_name}b",
        "--gpus",
        "1",
        "--nodelist",
        "n2",
        "--detach",
    )
    rid = second["replicas"][0]["replica_id"]
    row = wait_for(
        lambda: (r := _replica(xhpc, rid))["reason"] == "Resources" and r, 30, "the pending reason"
    )
    assert isinstance(row, dict) and row["state"] == "QUEUED"
    # When the GPUs free up, the queued replica starts and becomes READY on its own.
    xhpc.json("stop", f"{unique_name}a")
    wait_for(lambda: _replica(xhpc, rid)["state"] == "READY", 120, "the queued replica")
    assert xhpc.json("stop", f"{unique_name}b")[0]["state"] == "STOPPED"


def test_time_limit_signal_drains_and_stops(xhpc: Xhpc, unique_name: str) -> None:
    dep = xhpc.json("serve", "tiny-llama", "--name", unique_name, "--timeout", "240")
    (replica,) = dep["replicas"]
    job_id = str(replica["job_id"])
    # What Slurm sends before the time limit (#SBATCH --signal=B:USR1@60), sent now.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env(), check=True)
    wait_for(
        lambda: _replica(xhpc, str(replica["replica_id"]))["state"] == "STOPPED",
        60,
        "the replica to drain and stop",
    )
    wait_for(lambda: job_id not in xhpc.my_jobs(), 60, "the job to end")
    out = xhpc.state_dir / "replicas" / str(replica["replica_id"]) / f"slurm-{job_id}.out"
    assert "stopping the engine" in out.read_text()
