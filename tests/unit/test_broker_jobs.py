"""Job rows as the broker keeps them (component tests: real SQLite, a recording Slurm).

Slurm's job ids restart after a controller rebuild, so one id may name jobs of two replicas:
each replica reads and updates only its own row, and a row is closed once its replica leaves
the job.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import msgspec

from tests.unit.test_broker_service import ORPHAN_USER, make
from xhpc.clock import utcnow
from xhpc.models import JobInfo, NodeInfo, ReplicaState, ServeRequest
from xhpc.orphans import OrphanFixRequest, OrphanPolicy
from xhpc.store import ReplicaRow, Store

S = ReplicaState


def _age(store: Store, *replica_ids: str, by: timedelta = timedelta(minutes=1)) -> None:
    """Rows last changed ``by`` ago: past the reconcile and orphan graces."""
    with store.session() as s:
        for rid in replica_ids:
            row = s.get(ReplicaRow, rid)
            assert row is not None
            row.updated_at = utcnow() - by
            s.add(row)


def _job(job_id: str, state: str) -> JobInfo:
    return JobInfo(job_id=job_id, raw_job_id=int(job_id), name="x", state=state)


def _tagged(job_id: str, replica_id: str) -> JobInfo:
    """A running job of this user tagged for ``replica_id`` of deployment m."""
    job = _job(job_id, "RUNNING")
    return msgspec.structs.replace(job, user=ORPHAN_USER, comment=f"xhpc:m:{replica_id}")


async def test_logs_of_two_replicas_whose_jobs_share_an_id_never_mix(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    service.lifecycle.move(service.store.replica("m-0"), S.FAILED, "its node was rebuilt")
    slurm.submitted.clear()  # the controller was rebuilt: ids start again at 100
    await service.serve(ServeRequest(model=str(model_dir), name="n"))
    first, second = service.store.replica("m-0"), service.store.replica("n-0")
    assert first.job_id == second.job_id == "100"
    for row in (first, second):
        job = service.store.job(row.replica_id, "100")
        assert job is not None and job.output_path is not None
        Path(job.output_path.replace("%j", "100")).write_text(f"output of {row.replica_id}\n")
    assert service.logs("m-0").job_output.strip() == "output of m-0"
    assert service.logs("n-0").job_output.strip() == "output of n-0"
    old, new = service.store.jobs(job_id="100")
    assert (old.replica_id, new.replica_id) == ("m-0", "n-0")
    assert old.ended_at is not None and new.ended_at is None  # m-0 left its job as it failed


async def test_reconcile_closes_the_rows_of_ended_and_vanished_jobs(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir), replicas=3))
    _age(service.store, "m-0", "m-1", "m-2")
    # 100 ended, 101 vanished from squeue, 102 runs.
    slurm.queue = [_job("100", "COMPLETED"), _job("102", "RUNNING")]
    await service.reconcile_once()
    states = [service.store.replica(f"m-{i}").state for i in range(3)]
    assert states == ["FAILED", "LOST", "STARTING"]
    rows = {j.job_id: j for j in service.store.jobs()}
    assert (rows["100"].slurm_state, rows["100"].ended_at is not None) == ("COMPLETED", True)
    assert (rows["101"].slurm_state, rows["101"].ended_at is not None) == ("PENDING", True)
    assert (rows["102"].slurm_state, rows["102"].ended_at) == ("RUNNING", None)


async def test_orphan_fixes_close_the_rows_of_jobs_their_replicas_left(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=2))
    r0, r1 = (r.replica_id for r in dep.replicas)
    _age(service.store, r0, r1)
    slurm.queue = [_tagged("100", r0)]  # job 101 has vanished
    await service.fix_orphans(OrphanFixRequest())  # replica_without_job: mark-lost by default
    assert service.store.replica(r1).state == "LOST"
    lost = service.store.job(r1, "101")
    assert lost is not None and lost.ended_at is not None
    # Its job turns up under another id: the row adopts it, a new job row opens.
    slurm.queue = [_tagged("100", r0), _tagged("777", r1)]
    await service.fix_orphans(OrphanFixRequest(policy=OrphanPolicy(job_without_replica="adopt")))
    assert service.store.replica(r1).job_id == "777"
    assert [(j.job_id, j.ended_at is None) for j in service.store.jobs(replica_id=r1)] == [
        ("101", False),
        ("777", True),
    ]
