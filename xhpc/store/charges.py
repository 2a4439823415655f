"""The Slurm jobs xhpc submitted for deployments, and whose deployment each was (for the GPU-hours
of `xhpc usage`): every run of a replica's own job and every PD unit's hetjob (the jobs table).
A pilot's job is not here: it serves several deployments at once."""

from __future__ import annotations

from sqlmodel import col, select

from xhpc.access import JobCharge
from xhpc.clock import aware
from xhpc.models import JobKind, JobState
from xhpc.store.store import Store
from xhpc.store.tables import DeploymentRow, JobRow, JobRunRow, ReplicaRow


def job_charges(store: Store) -> list[JobCharge]:
    """Every run of a deployment's job, oldest first within its kind."""
    with store.session() as s:
        runs = s.exec(
            select(JobRunRow, DeploymentRow.name, DeploymentRow.owner)
            .join(ReplicaRow, col(JobRunRow.replica_id) == col(ReplicaRow.replica_id))
            .join(DeploymentRow, col(ReplicaRow.deployment) == col(DeploymentRow.name))
            .order_by(col(JobRunRow.id))
        ).all()
        units = s.exec(
            select(JobRow, DeploymentRow.owner)
            .join(DeploymentRow, col(JobRow.deployment) == col(DeploymentRow.name))
            .where(JobRow.kind == JobKind.UNIT.value, col(JobRow.job_id).is_not(None))
            .order_by(col(JobRow.created_at))
        ).all()
    charges = [
        JobCharge(
            run=f"job-{job.id}",
            job_id=job.job_id,
            model=name,
            owner=owner,
            submitted_at=aware(job.submitted_at),
            ended_at=aware(job.ended_at) if job.ended_at is not None else None,
        )
        for job, name, owner in runs
    ]
    for unit, owner in units:
        if unit.job_id is None:  # not selected: narrows the type
            continue
        ended = unit.state == JobState.ENDED.value
        charges.append(
            JobCharge(
                run=f"unit-{unit.key}",
                job_id=unit.job_id,
                model=unit.deployment or "",
                owner=owner,
                submitted_at=aware(unit.created_at),
                ended_at=aware(unit.updated_at) if ended else None,
            )
        )
    return charges
