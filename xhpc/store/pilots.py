"""Pilot jobs: the jobs of kind ``pilot`` in the one jobs table (xhpc.store.jobs), as pilots.
Its replicas point at it (``pilot_id``)."""

from __future__ import annotations

from collections.abc import Sequence

from xhpc.clock import utcnow
from xhpc.models import JobKind, JobState, PilotState, PilotView
from xhpc.records import JobRecord, PilotRecord, ReplicaRecord
from xhpc.store.jobs import Jobs
from xhpc.store.store import Store

PILOT = JobKind.PILOT
LIVE_PILOT = (JobState.PENDING, JobState.RUNNING)


def pilot_record(job: JobRecord) -> PilotRecord:
    """A pilot job as a pilot: its node, the GPUs it holds, its directory, its agent's token."""
    return PilotRecord(
        pilot_id=job.key,
        node=job.node or "",
        gpus=job.gpus,
        state=PilotState(job.state.value),
        job_id=job.job_id,
        token_hash=job.token_hash or "",
        pilot_dir=job.job_dir or "",
        output_path=job.output_path,
        devices=job.devices,
        reason=job.reason,
        last_heartbeat=job.last_heartbeat,
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


class Pilots:
    def __init__(self, store: Store) -> None:
        self.jobs = Jobs(store)

    def add(self, pilot: PilotRecord) -> None:
        self.jobs.add(
            [
                JobRecord(
                    key=pilot.pilot_id,
                    kind=PILOT,
                    node=pilot.node,
                    gpus=pilot.gpus,
                    state=JobState(pilot.state.value),
                    job_id=pilot.job_id,
                    token_hash=pilot.token_hash,
                    job_dir=pilot.pilot_dir,
                    output_path=pilot.output_path,
                    devices=pilot.devices,
                    reason=pilot.reason,
                    last_heartbeat=pilot.last_heartbeat,
                    created_at=pilot.created_at,
                    updated_at=pilot.updated_at,
                )
            ]
        )

    def get(self, pilot_id: str) -> PilotRecord:
        return pilot_record(self.jobs.get(PILOT, pilot_id))

    def live(self) -> list[PilotRecord]:
        """Pilots whose job is pending or running (not being cancelled, not ended)."""
        return [pilot_record(j) for j in self.jobs.find(PILOT, states=LIVE_PILOT)]

    def not_ended(self) -> list[PilotRecord]:
        return [pilot_record(j) for j in self.not_ended_jobs()]

    def not_ended_jobs(self) -> list[JobRecord]:
        """The pilots not ended, as the jobs-table rows they are."""
        return self.jobs.find(PILOT, states=set(JobState) - {JobState.ENDED})

    def live_on(self, node: str, exclude: str | None = None) -> PilotRecord | None:
        """The live pilot on ``node`` (not ``exclude``: a pilot whose time is running out)."""
        return next((p for p in self.live() if p.node == node and p.pilot_id != exclude), None)

    def transition(self, pilot_id: str, target: PilotState, reason: str | None = None) -> None:
        """A state change: validated by the one job machine (xhpc.states), evented, logged."""
        self.jobs.transition(PILOT, pilot_id, JobState(target.value), reason)

    def place(self, pilot_id: str, job_id: str, reason: str | None = None) -> None:
        self.jobs.place(PILOT, pilot_id, job_id, reason)

    def heard(self, pilot_id: str, devices: Sequence[int], state: PilotState | None = None) -> None:
        """Record its agent's heartbeat: the devices its job sees, the time, a new state."""
        target = JobState(state.value) if state is not None else None
        self.jobs.heard(PILOT, pilot_id, devices, utcnow(), target)

    def replicas(self, pilot_id: str, *, active_only: bool = True) -> list[ReplicaRecord]:
        return self.jobs.hosted(pilot_id, active_only=active_only)

    def view(self, pilot: PilotRecord) -> PilotView:
        return PilotView(
            pilot_id=pilot.pilot_id,
            node=pilot.node,
            gpus=pilot.gpus,
            state=pilot.state,
            job_id=pilot.job_id,
            devices=pilot.devices,
            replicas=tuple(r.replica_id for r in self.replicas(pilot.pilot_id)),
        )

    def next_id(self) -> str:
        return f"pilot-{self.jobs.count(PILOT) + 1}"
