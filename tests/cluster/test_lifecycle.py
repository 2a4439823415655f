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
    dep = xhpc.json(
        "serve", "tiny-llama", "--name", unique_name, "--replicas", "2", "--restart", "never",
        "--timeout", "240",
    )  # fmt: skip
    first, second = dep["replicas"]
    job_id = str(first["job_id"])
    # What Slurm sends before the time limit (#SBATCH --signal=B:USR1@60), sent now: with the
    # other replica READY to take its traffic, this one drains, then its job is cancelled.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env(), check=True)
    wait_for(
        lambda: _replica(xhpc, str(first["replica_id"]))["state"] == "STOPPED",
        60,
        "the replica to drain and stop",
    )
    wait_for(lambda: job_id not in xhpc.my_jobs(), 60, "the job to end")
    out = xhpc.state_dir / "replicas" / str(first["replica_id"]) / f"slurm-{job_id}.out"
    assert "draining" in out.read_text()
    # The last replica gets the same warning: alone, it serves on to its job's end.
    last = str(second["job_id"])
    subprocess.run(["scancel", "--signal=USR1", "--batch", last], env=slurm_env(), check=True)
    wait_for(
        lambda: "serving to the end" in str(_replica(xhpc, str(second["replica_id"]))["reason"]),
        30,
        "the last replica to say it serves to the end",
    )
    assert _replica(xhpc, str(second["replica_id"]))["state"] == "READY"
    assert xhpc.json("stop", unique_name)[0]["state"] in ("DRAINING", "STOPPED")
