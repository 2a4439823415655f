"""PD units: the jobs of kind ``unit`` in the one jobs table (xhpc.store.jobs), as units. Its
instances are replica rows with ``pd_unit``."""

from __future__ import annotations

from xhpc.models import JobKind, JobState, UnitState
from xhpc.records import JobRecord, ReplicaRecord, UnitRecord
from xhpc.store.jobs import Jobs
from xhpc.store.store import Store

UNIT = JobKind.UNIT
LIVE_UNIT = (JobState.STARTING, JobState.READY, JobState.DEGRADED)


def unit_record(job: JobRecord) -> UnitRecord:
    return UnitRecord(
        unit_id=job.key,
        deployment=job.deployment or "",
        index=job.index,
        spec=job.spec,
        job_id=job.job_id,
        state=UnitState(job.state.value),
        reason=job.reason,
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


class Units:
    def __init__(self, store: Store) -> None:
        self.jobs = Jobs(store)

    def add(self, units: list[UnitRecord], job_dirs: dict[str, str] | None = None) -> None:
        dirs = job_dirs or {}
        self.jobs.add(
            [
                JobRecord(
                    key=u.unit_id,
                    kind=UNIT,
                    deployment=u.deployment,
                    index=u.index,
                    spec=u.spec,
                    state=JobState(u.state.value),
                    job_id=u.job_id,
                    job_dir=dirs.get(u.unit_id),
                    reason=u.reason,
                    created_at=u.created_at,
                    updated_at=u.updated_at,
                )
                for u in units
            ]
        )

    def get(self, unit_id: str) -> UnitRecord:
        return unit_record(self.jobs.get(UNIT, unit_id))

    def of(self, deployment: str, *, live_only: bool = False) -> list[UnitRecord]:
        states = LIVE_UNIT if live_only else None
        found = self.jobs.find(UNIT, states=states, deployment=deployment, by_index=True)
        return [unit_record(j) for j in found]

    def live(self, *, stopping: bool = False) -> list[UnitRecord]:
        """Units not ended (and, with ``stopping``, those being stopped too)."""
        states = (*LIVE_UNIT, JobState.STOPPING) if stopping else LIVE_UNIT
        return [unit_record(j) for j in self.jobs.find(UNIT, states=states)]

    def next_index(self, deployment: str) -> int:
        return max((u.index for u in self.of(deployment)), default=-1) + 1

    def transition(self, unit_id: str, target: UnitState, reason: str | None = None) -> None:
        """A state change: validated by the one job machine (xhpc.states), evented, logged."""
        self.jobs.transition(UNIT, unit_id, JobState(target.value), reason)

    def place(self, unit_id: str, job_id: str) -> None:
        self.jobs.place(UNIT, unit_id, job_id)

    def instances(self, unit_id: str, *, active_only: bool = False) -> list[ReplicaRecord]:
        return self.jobs.hosted(unit_id, active_only=active_only)
