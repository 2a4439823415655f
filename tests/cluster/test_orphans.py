"""Orphans on the real cluster: `xhpc doctor --orphans` against real squeue and real probes.

Other brokers (other tests, other sessions) may share the cluster and the user: their jobs can be
orphans to this broker too, so these tests look for their own orphan in the report, never for an
exact list, and narrow `--fix` to their own job with `--job`.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.conftest import NodeProbes, Xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster]


def _doctor(x: Xhpc, *args: str) -> tuple[int, Any]:
    proc = x.run("doctor", "--orphans", "--json", *args, check=False)
    assert proc.returncode in (0, 1), proc.stderr  # 0 clean, 1 orphans; anything else: an error
    return proc.returncode, json.loads(proc.stdout)


def _submit_ghost(x: Xhpc) -> str:
    """A job tagged as xhpc's that no replica row knows. Its script lives in the test's state dir,
    so it is one of ``x.my_jobs()`` and the fixture cancels it if the test fails."""
    script = x.state_dir / "ghost.sbatch"
    script.write_text("#!/bin/bash\nexec sleep 300\n")
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--comment=xhpc:ghost:ghost-0",
            "--job-name=xhpc-ghost-0",
            f"--output={x.state_dir}/ghost.out",
            str(script),
        ],
        env=slurm_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.strip().split(";")[0]


def _ghost_in(report: Any, job_id: str) -> dict[str, Any] | None:
    return next((j for j in report["jobs"] if j["job_id"] == job_id), None)


def test_doctor_reports_then_cancels_a_tagged_job_with_no_replica(xhpc: Xhpc) -> None:
    job_id = _submit_ghost(xhpc)
    assert job_id in xhpc.my_jobs()

    # The broker reads a shared squeue view at most a few seconds old.
    def listed() -> dict[str, Any] | None:
        code, report = _doctor(xhpc)
        return _ghost_in(report, job_id) if code == 1 else None

    orphan = wait_for(listed, 30, "the ghost job in the orphan report")
    assert isinstance(orphan, dict)
    assert orphan["kind"] == "job_without_replica"
    assert (orphan["deployment"], orphan["replica_id"]) == ("ghost", "ghost-0")
    assert orphan["row_state"] is None and orphan["reason"] == "no replica row"

    # The default policy only reports jobs: --fix alone leaves the job alone, and says so.
    code, result = _doctor(xhpc, "--fix", "--job", job_id)
    assert code == 1 and result["unresolved"] >= 1
    (act,) = [a for a in result["actions"] if a["action"]["job_id"] == job_id]
    assert act["action"]["action"] == "report"
    assert job_id in xhpc.my_jobs()

    # --cancel-unknown-jobs sets the policy for this run; --job keeps it to our own ghost.
    code, result = _doctor(xhpc, "--fix", "--cancel-unknown-jobs", "--job", job_id)
    (act,) = [a for a in result["actions"] if a["action"]["job_id"] == job_id]
    assert act["action"]["action"] == "cancel" and act["applied"], act
    wait_for(lambda: job_id not in xhpc.my_jobs(), 60, "the ghost job to leave squeue")
    # The report reads the broker's shared view of Slurm, which may be up to
    # placement.max_view_age_s older than that squeue: gone from it at the next view.
    wait_for(lambda: _ghost_in(_doctor(xhpc)[1], job_id) is None, 30, "the ghost out of the report")


def test_doctor_reports_a_foreign_gpu_process_and_never_kills_it(
    xhpc_placeholder: Xhpc, node_probes: NodeProbes
) -> None:
    x = xhpc_placeholder
    node_probes.write(
        "n2", "count = 4\n[[gpus]]\nindex = 3\nprocesses = [{ pid = 4242, mem_used_mb = 1024 }]\n"
    )

    def seen() -> dict[str, Any] | None:
        _, report = _doctor(x)
        return next((g for g in report["gpu_processes"] if g["node"] == "n2"), None)

    orphan = wait_for(seen, 30, "the foreign process in the orphan report")
    assert isinstance(orphan, dict)
    assert (orphan["gpu"], orphan["pid"], orphan["mem_used_mb"]) == (3, 4242, 1024)
    assert orphan["job_id"] is None and orphan["reason"] == "no Slurm job"

    code, result = _doctor(x, "--fix", "--cancel-unknown-jobs", "--job", "none")
    (act,) = [a for a in result["actions"] if a["action"]["kind"] == "gpu_process"]
    assert code == 1 and act["action"]["action"] == "report" and not act["applied"]

    # Once the process is gone from the probe, the orphan is gone from the report.
    node_probes.write("n2", "count = 4\n")
    wait_for(lambda: not seen(), 30, "the foreign process to leave the report")
