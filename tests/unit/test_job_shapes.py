"""Job shapes: one launcher path, and what differs per kind of job as a few hooks."""

from __future__ import annotations

import inspect
from datetime import UTC, datetime
from pathlib import Path

from xhpc.broker.admit.shapes import SHAPES, Hosting, shape_hosting, shape_of
from xhpc.broker.desks import launcher
from xhpc.broker.plan.plans import JobKind, JobPlan, ReplicaPlan
from xhpc.models import AgentSpec, EngineKind
from xhpc.render import SbatchParams

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _replica(rid: str, node: str | None, gpus: int = 1) -> ReplicaPlan:
    spec = AgentSpec(replica_id=rid, deployment="m", engine=EngineKind.VLLM, model_path="/m",
                     served_model="m", broker_file="/b")  # fmt: skip
    sbatch = SbatchParams(replica_id=rid, deployment="m", job_name=rid, comment="t",
                          gpus=gpus, time="00:10:00", output="/o", agent_python="/p",
                          replica_dir="/r")  # fmt: skip
    return ReplicaPlan(replica_id=rid, index=0, node=node, replica_dir=Path("/r") / rid, spec=spec,
                       sbatch=sbatch)  # fmt: skip


def _job(kind: JobKind, key: str, hosts: tuple[ReplicaPlan, ...], script: str = "#!/bin/sh\n",
         node: str | None = None, gpus: int = 0) -> JobPlan:  # fmt: skip
    return JobPlan(kind=kind, key=key, index=0, job_dir=Path("/j") / key, tag="t", script=script,
                   node=node, gpus=gpus, hosts=hosts)  # fmt: skip


def test_every_kind_has_a_shape() -> None:
    assert set(SHAPES) == set(JobKind)


def test_the_launcher_never_asks_which_kind_a_job_is() -> None:
    source = inspect.getsource(launcher)
    assert "JobKind." not in source and ".kind is" not in source and ".kind ==" not in source
    assert "pilot_id is None" not in source and "pd_unit is None" not in source


def test_a_unit_components_record_the_hetjob_id_with_their_offset() -> None:
    unit = _job(JobKind.UNIT, "m-u0", (_replica("m-u0-p0", "n1"), _replica("m-u0-d0", "n2")))
    ids = [(r.replica_id, j) for r, j in shape_of(unit).replica_job_ids(unit, "90")]
    assert ids == [("m-u0-p0", "90+0"), ("m-u0-d0", "90+1")]
    assert [(r.node, r.gpus) for r in shape_of(unit).reservations(unit, T0)] == [
        ("n1", 1),
        ("n2", 1),
    ]
    assert shape_of(unit).hosting(unit).unit == "m-u0" and not shape_of(unit).own_runs


def test_a_new_pilot_books_its_gpus_once_and_a_join_books_nothing_and_writes_no_row() -> None:
    hosts = (_replica("m-0", None), _replica("m-1", None))
    new = _job(JobKind.PILOT, "pilot-1", hosts, node="n1", gpus=4)
    join = _job(JobKind.PILOT, "pilot-1", hosts, script="")
    shape = shape_of(new)
    assert [(r.replica_id, r.node, r.gpus) for r in shape.reservations(new, T0)] == [
        ("m-0", "n1", 4)
    ]
    assert shape.reservations(join, T0) == [] and not shape.needs_token(join)
    assert [j for _, j in shape.replica_job_ids(new, "70")] == ["70", "70"]


def test_a_replica_job_is_its_replica_own_and_has_no_row_in_the_jobs_table() -> None:
    job = _job(JobKind.REPLICA, "m-0", (_replica("m-0", "n3", gpus=2),))
    shape = shape_of(job)
    assert shape.own_runs and shape.hosting(job).pilot is None and shape.hosting(job).unit is None
    assert [(r.node, r.gpus) for r in shape.reservations(job, T0)] == [("n3", 2)]


def test_a_replica_row_s_host_names_the_shape_of_its_job() -> None:
    assert shape_hosting(Hosting()).own_runs
    assert shape_hosting(Hosting(pilot="pilot-1")).kind is JobKind.PILOT
    assert shape_hosting(Hosting(unit="m-u0")).kind is JobKind.UNIT
