"""Re-planning: a replica stuck PENDING on the node xhpc chose moves to a node that fits now."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    PLACEHOLDER_ENGINE,
    Xhpc,
    _start_xhpc,
    _teardown_xhpc,
    slurm_env,
    wait_for,
)

pytestmark = pytest.mark.cluster


@pytest.fixture
def quick_replan(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, PLACEHOLDER_ENGINE + "\n[placement]\nreplan_after_s = 2\n")
    yield x
    _teardown_xhpc(x)


@pytest.fixture
def n1_reserved(dev_cluster: Path, unique_name: str) -> Iterator[str]:
    """A maintenance reservation on n1: sinfo still shows n1 idle, but jobs cannot start there
    (they pend with ReqNodeNotAvail) -- what xhpc's snapshot cannot see in advance."""
    name = f"maint-{unique_name}"
    subprocess.run(
        [
            "scontrol",
            "create",
            "reservation",
            f"reservationname={name}",
            "nodes=n1",
            "starttime=now",
            "duration=30",
            "users=nobody",
            "flags=maint,ignore_jobs",
        ],
        env=slurm_env(),
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(
            ["scontrol", "delete", f"reservation={name}"],
            env=slurm_env(),
            check=False,
            capture_output=True,
        )


def test_a_replica_pending_on_its_node_is_replanned(
    quick_replan: Xhpc, n1_reserved: str, unique_name: str
) -> None:
    x = quick_replan
    dep = x.json("serve", "tiny-llama", "--name", unique_name, "--engine", "command", "--detach")
    (first,) = dep["replicas"]
    rid, old_job = first["replica_id"], first["job_id"]

    def row() -> dict[str, Any]:
        (r,) = [r for r in x.json("ps") if r["replica_id"] == rid]
        return r

    # Every node is idle, so xhpc's tie-break chooses n1, where the job cannot start; the
    # re-plan may come before `ps` shows the pending reason, so its log line is the proof.
    wait_for(lambda: row()["job_id"] != old_job, 60, "the re-plan")
    log = (x.state_dir / "broker.log").read_text()
    assert f"job {old_job} waited on n1 (ReqNodeNotAvail); re-planned to n2" in log, log
    script = (x.state_dir / "replicas" / rid / "job.sbatch").read_text()
    assert "#SBATCH --nodelist=n2" in script
    placed = wait_for(lambda: (r := row())["node"] and r, 30, "the new job to start")
    assert isinstance(placed, dict) and placed["node"] == "n2" and placed["state"] == "STARTING"
    assert old_job not in x.my_jobs()
    x.run("stop", unique_name)
