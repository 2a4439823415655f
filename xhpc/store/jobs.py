"""The one jobs table: every Slurm job that hosts replicas (a pilot, a PD unit), whatever its
kind, with one state machine (xhpc.states). Its replicas point at it (``pilot_id``, ``pd_unit``).

Reads hand out frozen ``JobRecord`` values; writes are typed commands: add the planned jobs, a
transition (validated, evented, logged), a placement (the Slurm job id it runs as), a heartbeat
(its agent's word: the devices it sees)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlmodel import Session, col, select

from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.models import JobKind, JobState
from xhpc.records import JobRecord, ReplicaRecord
from xhpc.states import ACTIVE, check_job_transition
from xhpc.store.rows import as_record, indexes, indexes_text, replica_record
from xhpc.store.store import Store, state_event
from xhpc.store.tables import JobRow, ReplicaRow

_WHAT = {JobKind.REPLICA: "job", JobKind.PILOT: "pilot", JobKind.UNIT: "PD unit"}


def job_record(row: JobRow) -> JobRecord:
    return as_record(JobRecord, row, index=row.idx, devices=indexes(row.devices))


def _row(job: JobRecord) -> JobRow:
    return JobRow(
        key=job.key,
        kind=job.kind.value,
        deployment=job.deployment,
        idx=job.index,
        spec=job.spec,
        node=job.node,
        gpus=job.gpus,
        state=job.state.value,
        job_id=job.job_id,
        token_hash=job.token_hash,
        job_dir=job.job_dir,
        output_path=job.output_path,
        devices=indexes_text(job.devices),
        reason=job.reason,
        last_heartbeat=job.last_heartbeat,
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


class Jobs:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, jobs: Sequence[JobRecord]) -> None:
        """Record planned jobs (in one transaction)."""
        with self.store.session() as s:
            for job in jobs:
                s.add(_row(job))

    def get(self, kind: JobKind, key: str) -> JobRecord:
        with self.store.session() as s:
            return job_record(self._get(s, kind, key))

    def find(
        self,
        kind: JobKind,
        *,
        states: Iterable[JobState] | None = None,
        deployment: str | None = None,
        by_index: bool = False,
    ) -> list[JobRecord]:
        """Jobs of ``kind`` (in ``states``, of ``deployment``), by key (or by index)."""
        with self.store.session() as s:
            q = select(JobRow).where(JobRow.kind == kind.value)
            if states is not None:
                q = q.where(col(JobRow.state).in_([st.value for st in states]))
            if deployment is not None:
                q = q.where(JobRow.deployment == deployment)
            q = q.order_by(col(JobRow.idx) if by_index else col(JobRow.key))
            return [job_record(row) for row in s.exec(q).all()]

    def count(self, kind: JobKind) -> int:
        with self.store.session() as s:
            return len(s.exec(select(JobRow.key).where(JobRow.kind == kind.value)).all())

    def transition(
        self, kind: JobKind, key: str, target: JobState, reason: str | None = None
    ) -> JobRecord:
        """Move a job to ``target`` (validated against the one machine, evented, logged), with
        ``reason`` as its reason (staying in its state only sets that)."""
        with self.store.session() as s:
            row = self._get(s, kind, key)
            self._move(s, row, kind, target, reason)
            return self._touch(s, row)

    def place(self, kind: JobKind, key: str, job_id: str, reason: str | None = None) -> JobRecord:
        """Record the Slurm job ``key`` runs as (sbatch's answer, or a job found by its tag)."""
        with self.store.session() as s:
            row = self._get(s, kind, key)
            row.job_id = job_id
            if reason is not None:
                row.reason = reason
            return self._touch(s, row)

    def heard(
        self,
        kind: JobKind,
        key: str,
        devices: Sequence[int],
        at: datetime,
        state: JobState | None = None,
    ) -> JobRecord:
        """Record its agent's heartbeat: the devices its job sees, the time, a new state (in
        one transaction)."""
        with self.store.session() as s:
            row = self._get(s, kind, key)
            if state is not None:
                self._move(s, row, kind, state, None)
            row.devices = indexes_text(devices)
            row.last_heartbeat = at
            return self._touch(s, row)

    def hosted(self, key: str, *, active_only: bool = False) -> list[ReplicaRecord]:
        """The replicas job ``key`` hosts (a pilot's, a unit's instances), by replica id."""
        with self.store.session() as s:
            q = select(ReplicaRow).where(
                (col(ReplicaRow.pilot_id) == key) | (col(ReplicaRow.pd_unit) == key)
            )
            if active_only:
                q = q.where(col(ReplicaRow.state).in_([st.value for st in ACTIVE]))
            return [replica_record(r) for r in s.exec(q.order_by(col(ReplicaRow.replica_id)))]

    @staticmethod
    def _get(s: Session, kind: JobKind, key: str) -> JobRow:
        row = s.get(JobRow, key)
        if row is None or row.kind != kind.value:
            raise NotFoundError(f"no {_WHAT[kind]} named {key!r}")
        return row

    @staticmethod
    def _move(s: Session, row: JobRow, kind: JobKind, target: JobState, reason: str | None) -> None:
        """The one machine's move, with its event (in the caller's transaction)."""
        current = JobState(row.state)
        if target is not current:
            check_job_transition(kind, row.key, current, target)
            s.add(state_event(_event_kind(kind), row.key, current.value, target.value, reason))
            row.state = target.value
        row.reason = reason

    @staticmethod
    def _touch(s: Session, row: JobRow) -> JobRecord:
        row.updated_at = utcnow()
        s.add(row)
        s.flush()
        return job_record(row)


def _event_kind(kind: JobKind) -> str:
    """The event kind a job's state change is recorded under (as before the one table)."""
    return kind.value
