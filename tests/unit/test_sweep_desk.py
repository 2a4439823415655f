"""Crash-safe submission with real SQLite and a hand-written Slurm stand-in (component tests).

An sbatch that times out after Slurm accepted the job, a broker that crashed between sbatch and
the store, a pilot that was never submitted: the launcher and the sweep find jobs by their tag
and adopt or cancel them, so no job runs without a live row and no row has two jobs.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from tests.unit.test_broker_service import ORPHAN_USER, RecordingSlurm, make
from xhpc.broker.admit.tags import job_tag, pilot_tag, unit_tag
from xhpc.broker.desks.launcher import submit_tagged
from xhpc.broker.desks.sweep_desk import SweepDesk, SweepResult
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.changes import ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import SlurmError, SlurmTimeoutError
from xhpc.models import (
    EngineKind,
    JobInfo,
    NodeInfo,
    PilotState,
    ReplicaState,
    ServeRequest,
    UnitState,
)
from xhpc.records import DeploymentRecord, PilotRecord, ReplicaRecord, UnitRecord
from xhpc.store import Store
from xhpc.store.pilots import Pilots
from xhpc.store.units import Units

S = ReplicaState
ME = ORPHAN_USER
BROKER = "b1"


def _comment(script: Path) -> str | None:
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --comment="):
            return shlex.split(line.split("=", 1)[1])[0]
    return None


class SweepSlurm(RecordingSlurm):
    """sbatch as ``outcomes`` script it (one per call; default "accepted"): "timeout-accepted"
    (Slurm took the job, sbatch was killed at its timeout), "timeout-lost" (it took nothing),
    "timeout-late" (it takes the job only after the broker looked: ``late``). What Slurm takes
    shows in squeue with the script's tag (a unit's hetjob: one entry per component); scancel
    marks jobs CANCELLED, as squeue shows them for a while."""

    def __init__(self, nodes: list[NodeInfo], store: Store, fail_on: int | None = None) -> None:
        super().__init__(nodes, store, fail_on)
        self.outcomes: list[str] = []
        self.calls = 0
        self.late: list[JobInfo] = []
        self.squeue_fails = False  # once sbatch has been called

    async def jobs(self, job_ids: Sequence[str] = ()) -> list[JobInfo]:
        if self.squeue_fails and self.calls:
            raise SlurmError("squeue failed", argv=["squeue"], returncode=1, stderr="down")
        return list(self.queue)

    def _accept(self, script: Path) -> list[JobInfo]:
        job_id = 100 + len(self.submitted)
        self.submitted.append(str(job_id))
        parts = script.read_text().count("#SBATCH hetjob") + 1
        het = parts > 1
        return [
            JobInfo(
                job_id=f"{job_id}+{k}" if het else str(job_id),
                raw_job_id=job_id + k,
                name=script.parent.name,
                state="PENDING",
                user=ME,
                comment=_comment(script),
                het_job_id=job_id if het else None,
                het_job_offset=k if het else None,
            )
            for k in range(parts)
        ]

    async def submit(self, script: Path) -> str:
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else "accepted"
        if outcome == "timeout-late":
            self.late += self._accept(script)
        elif outcome != "timeout-lost":
            self.queue += self._accept(script)
        if outcome == "accepted":
            return self.submitted[-1]
        raise SlurmTimeoutError("sbatch failed (timed out after 30s)", argv=["sbatch"])

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None:
        await super().cancel(job_ids, signal)
        gone = set(job_ids)
        self.queue = [
            msgspec.structs.replace(j, state="CANCELLED")
            if j.job_id in gone or str(j.het_job_id) in gone
            else j
            for j in self.queue
        ]


def _desk(store: Store, slurm: RecordingSlurm, broker: str = BROKER, **kw: float) -> SweepDesk:
    return SweepDesk(store, slurm, Lifecycle(store), broker, user=ME, **kw)


def _summary(results: list[SweepResult]) -> list[tuple[str, str, str | None, bool]]:
    return [(r.action.kind.value, r.action.name, r.action.job_id, r.applied) for r in results]


def _store(tmp_path: Path) -> tuple[Store, SweepSlurm]:
    store = Store(tmp_path / "state" / "x.db")
    return store, SweepSlurm([], store)


def _deployment(store: Store, *rows: ReplicaRecord, name: str = "m") -> None:
    now = utcnow()
    dep = DeploymentRecord(
        name=name, model=name, model_path="/m", engine=EngineKind.VLLM, gpus=1, created_at=now
    )
    store.create_deployment(dep, list(rows))


def _row(rid: str, pilot: str | None = None, unit: str | None = None) -> ReplicaRecord:
    now = utcnow()
    return ReplicaRecord(replica_id=rid, deployment="m", index=0, state=ReplicaState.CREATING,
                         engine=EngineKind.VLLM, pilot=pilot, unit=unit, created_at=now,
                         updated_at=now)  # fmt: skip


def _pilot(pilot_id: str, at: datetime) -> PilotRecord:
    return PilotRecord(pilot_id=pilot_id, node="n1", gpus=4, state=PilotState.PENDING,
                       token_hash="h", pilot_dir="/p", created_at=at, updated_at=at)  # fmt: skip


def _job(job_id: int, comment: str, user: str = ME, state: str = "RUNNING") -> JobInfo:
    return JobInfo(
        job_id=str(job_id), raw_job_id=job_id, name="x", state=state, user=user, comment=comment
    )


# -- the launcher: sbatch failed, but Slurm may have accepted the job -----------------------------


async def test_a_job_accepted_by_an_sbatch_that_timed_out_is_adopted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes = ["accepted", "timeout-accepted"]
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=2))
    assert [(r.state.value, r.job_id) for r in dep.replicas] == [
        ("QUEUED", "100"),
        ("QUEUED", "101"),
    ]
    assert slurm.cancelled == []
    assert service.store.job("m-1", "101") is not None  # recorded like any submitted job


async def test_a_timed_out_sbatch_with_no_job_fails_the_launch_and_cancels_what_it_submitted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes = ["accepted", "timeout-accepted", "timeout-lost"]
    with pytest.raises(SlurmTimeoutError):
        await service.serve(ServeRequest(model=str(model_dir), replicas=3))
    assert slurm.cancelled == ["100", "101"]  # the one found by its tag too
    rows = service.store.replicas(deployment="m")
    assert [r.state for r in rows] == ["FAILED"] * 3


async def test_a_job_slurm_takes_after_the_look_up_is_cancelled_by_the_sweep(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes = ["timeout-late"]
    with pytest.raises(SlurmTimeoutError):
        await service.serve(ServeRequest(model=str(model_dir)))
    slurm.queue += slurm.late  # slurmctld got to the submission after the broker looked
    desk = _desk(service.store, slurm, service.broker_id)
    assert await desk.run(slurm.queue) == []  # the FAILED row is too fresh to judge
    desk.grace_s = 0.0
    assert _summary(await desk.run(slurm.queue)) == [("cancel", "m-0", "100", True)]
    assert await desk.run(slurm.queue) == []  # cancelled: nothing left to do


async def test_when_squeue_cannot_say_the_launch_fails_with_the_sbatch_error(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes, slurm.squeue_fails = ["timeout-accepted"], True
    with pytest.raises(SlurmTimeoutError):
        await service.serve(ServeRequest(model=str(model_dir)))
    assert service.store.replica("m-0").state == "FAILED"
    assert "submit action=lookup-failed" in caplog.text


async def test_a_pilot_job_accepted_by_an_sbatch_that_timed_out_is_adopted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes = ["timeout-accepted"]
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=2, pilot="n2"))
    assert [(r.state.value, r.job_id) for r in dep.replicas] == [("QUEUED", "100")] * 2
    (pilot,) = service.pilot_desk.pilots.live()
    assert pilot.job_id == "100" and slurm.cancelled == []


async def test_a_units_hetjob_accepted_by_an_sbatch_that_timed_out_is_adopted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    slurm.outcomes = ["timeout-accepted"]
    req = ServeRequest(model=str(model_dir), pd="1P1D", engine=EngineKind.VLLM)
    dep = await service.serve(req)
    assert sorted(str(r.job_id) for r in dep.replicas) == ["100+0", "100+1"]


async def test_a_replans_job_accepted_by_an_sbatch_that_timed_out_is_recorded(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=SweepSlurm)
    assert isinstance(slurm, SweepSlurm)
    await service.serve(ServeRequest(model=str(model_dir)))
    slurm.queue = [msgspec.structs.replace(slurm.queue[0], reason="Resources")]
    service.config.placement.replan_after_s = 0.0
    slurm.outcomes = ["timeout-accepted"]
    view = await service.poller.view(max_age_s=0.0)
    assert await service.replanner.run(view, service.store.replicas(active_only=True)) == 1
    row = service.store.replica("m-0")
    assert (row.job_id, row.replans) == ("101", 1) and slurm.cancelled == ["100"]
    old, new = service.store.jobs(replica_id="m-0")
    assert (old.job_id, old.slurm_state, new.job_id, new.ended_at) == (
        "100",
        "CANCELLED",
        "101",
        None,
    )
    assert old.ended_at is not None  # the replica left it: its row is closed


async def test_of_two_jobs_under_one_tag_the_oldest_is_kept_and_the_other_cancelled(
    tmp_path: Path,
) -> None:
    _, slurm = _store(tmp_path)
    tag = job_tag(BROKER, "m", "m-0")
    slurm.outcomes = ["timeout-lost"]
    slurm.queue = [_job(8, tag), _job(7, tag), _job(6, tag, user="mallory")]
    assert await submit_tagged(slurm, tmp_path / "job.sbatch", tag, ME) == "7"
    assert slurm.cancelled == ["8"]


# -- the sweep ------------------------------------------------------------------------------------


async def test_a_job_submitted_before_a_crash_is_adopted_by_its_creating_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-0"), _row("m-1"))
    slurm.queue = [_job(42, job_tag(BROKER, "m", "m-0"), state="PENDING")]
    caplog.set_level(logging.INFO)
    desk = _desk(store, slurm)
    assert await desk.run(slurm.queue) == []  # within the grace: a launch may be in flight
    desk.grace_s = 0.0
    assert _summary(await desk.run(slurm.queue)) == [("adopt", "m-0", "42", True)]
    row = store.replica("m-0")
    assert (row.state, row.job_id) == ("QUEUED", "42") and store.job("m-0", "42") is not None
    assert store.replica("m-1").state == "CREATING"  # no job of its own: reconcile's to judge
    assert "sweep action=adopt job=42 replica=m-0 reason=" in caplog.text
    assert await desk.run(slurm.queue) == []


async def test_jobs_of_ended_rows_and_rows_that_record_another_job_are_cancelled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-0"), _row("m-1"))
    store.transition("m-0", S.FAILED, "never submitted")
    store.transition("m-1", S.QUEUED, "submitted", ReplicaChange(job_id="50"))
    slurm.queue = [
        _job(41, job_tag(BROKER, "m", "m-0")),
        _job(50, job_tag(BROKER, "m", "m-1")),
        _job(51, job_tag(BROKER, "m", "m-1")),
        _job(60, job_tag(BROKER, "ghost", "ghost-0")),
    ]
    results = await _desk(store, slurm, grace_s=0.0).run(slurm.queue)
    assert _summary(results) == [
        ("cancel", "ghost-0", "60", True),
        ("cancel", "m-0", "41", True),
        ("cancel", "m-1", "51", True),
    ]
    assert sorted(slurm.cancelled) == ["41", "51", "60"]
    assert 'sweep action=cancel job=60 replica=ghost-0 reason="no replica row"' in caplog.text


async def test_other_brokers_and_other_users_jobs_are_never_touched(tmp_path: Path) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-0"))
    store.transition("m-0", S.FAILED, "never submitted")
    slurm.queue = [
        _job(41, job_tag("b2", "m", "m-0")),
        _job(42, job_tag(BROKER, "m", "m-0"), user="mallory"),
        _job(43, "xhpc:m:m-0"),
        _job(44, pilot_tag("b2", "pilot-1")),
    ]
    assert await _desk(store, slurm, grace_s=0.0).run(slurm.queue) == []
    assert slurm.cancelled == []


async def test_a_phantom_pilot_ends_and_its_waiting_replicas_fail(tmp_path: Path) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-0", pilot="pilot-1"), _row("m-1", pilot="pilot-1"))
    store.transition("m-0", S.QUEUED, "in pilot pilot-1")
    Pilots(store).add(_pilot("pilot-1", utcnow() - timedelta(minutes=5)))
    results = await _desk(store, slurm, grace_s=0.0).run([])
    assert _summary(results) == [("fail-phantom-pilot", "pilot-1", None, True)]
    assert results[0].action.fails == ("m-0", "m-1")
    assert [store.replica(r).state for r in ("m-0", "m-1")] == ["FAILED", "FAILED"]
    assert "pilot never submitted" in str(store.replica("m-0").reason)
    assert Pilots(store).get("pilot-1").state == PilotState.ENDED.value
    assert store.get_deployment("m").stopped_at is not None


async def test_a_pilot_with_no_job_adopts_its_tagged_job_for_its_replicas(tmp_path: Path) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-0", pilot="pilot-1"), _row("m-1", pilot="pilot-1"))
    Pilots(store).add(_pilot("pilot-1", utcnow()))
    slurm.queue = [_job(70, pilot_tag(BROKER, "pilot-1"))]
    results = await _desk(store, slurm, grace_s=0.0).run(slurm.queue)
    assert _summary(results) == [("adopt", "pilot-1", "70", True)]
    assert Pilots(store).get("pilot-1").job_id == "70"
    assert [(store.replica(r).state, store.replica(r).job_id) for r in ("m-0", "m-1")] == [
        ("QUEUED", "70"),
        ("QUEUED", "70"),
    ]
    assert store.jobs(job_id="70") == []  # a pilot's job is not one replica's


async def test_a_unit_with_no_job_adopts_its_hetjob_component_by_component(
    tmp_path: Path,
) -> None:
    store, slurm = _store(tmp_path)
    _deployment(store, _row("m-u0-p0", unit="m-u0"), _row("m-u0-d0", unit="m-u0"))
    now = utcnow()
    Units(store).add(
        [UnitRecord(unit_id="m-u0", deployment="m", index=0, spec="1P1D",
                    state=UnitState.STARTING, created_at=now, updated_at=now)]
    )  # fmt: skip
    tag = unit_tag(BROKER, "m", "m-u0")
    slurm.queue = [
        JobInfo(job_id=f"90+{k}", raw_job_id=90 + k, name="x", state="PENDING", user=ME,
                comment=tag, het_job_id=90, het_job_offset=k)
        for k in (0, 1)
    ]  # fmt: skip
    results = await _desk(store, slurm, grace_s=0.0).run(slurm.queue)
    assert _summary(results) == [("adopt", "m-u0", "90", True)]
    assert Units(store).get("m-u0").job_id == "90"
    assert store.replica("m-u0-p0").job_id == "90+0" and store.replica("m-u0-d0").job_id == "90+1"
    # Once the unit has ended, its hetjob is cancelled once, by its leader.
    Units(store).transition("m-u0", UnitState.ENDED)
    assert _summary(await _desk(store, slurm, grace_s=0.0).run(slurm.queue)) == [
        ("cancel", "m-u0", "90", True)
    ]


async def test_a_failed_scancel_is_reported_and_retried_at_the_next_sweep(tmp_path: Path) -> None:
    store, slurm = _store(tmp_path)
    slurm.queue = [_job(60, job_tag(BROKER, "ghost", "ghost-0"))]

    async def broken(job_ids: Sequence[str], signal: str | None = None) -> None:
        raise SlurmError("scancel failed", argv=["scancel"], returncode=1, stderr="busy")

    slurm.cancel = broken  # type: ignore[method-assign]
    (result,) = await _desk(store, slurm, grace_s=0.0).run(slurm.queue)
    assert not result.applied and "scancel failed" in str(result.error)
