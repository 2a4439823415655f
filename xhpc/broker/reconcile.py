"""Reconcile diff (pure): replica rows + Slurm's job view -> actions that advance states."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from xhpc.models import JobInfo, ReplicaState
from xhpc.store.tables import ReplicaRow

S = ReplicaState

PENDING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
RUNNING_STATES = {"RUNNING"}
# COMPLETING is neither: the job's processes are still being cleaned up; wait for the end.
ENDED_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
    "REVOKED",
    "STOPPED",
}
# A replica whose job vanished from squeue this long after submission is LOST.
VANISH_GRACE = timedelta(seconds=10)
CREATING_GRACE = timedelta(seconds=120)


@dataclass(frozen=True)
class Action:
    replica_id: str
    target: ReplicaState | None = None
    reason: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    job_update: dict[str, Any] = field(default_factory=dict)


def _aware(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _for_job(row: ReplicaRow, job: JobInfo, stale_before: datetime, now: datetime) -> Action | None:
    state = S(row.state)
    job_update: dict[str, Any] = {"slurm_state": job.state, "reason": job.reason}
    if job.state in PENDING_STATES:
        reason = job.reason or "Pending"
        if state is S.QUEUED and row.reason != reason:
            return Action(row.replica_id, S.QUEUED, reason, job_update=job_update)
        return None
    if job.state in RUNNING_STATES:
        job_update.update(node=job.batch_host or job.nodes, gres_detail=",".join(job.gres_detail))
        fields: dict[str, Any] = {"node": job.batch_host or job.nodes}
        if job.gpus_idx and row.pilot_id is None:
            # Slurm's allocation is authoritative for the GPU indexes.
            fields["gpus"] = ",".join(str(g) for g in job.gpus_idx)
        if state is S.QUEUED:
            return Action(row.replica_id, S.STARTING, "job running", fields, job_update)
        heartbeat = _aware(row.last_heartbeat)
        if state is S.READY and heartbeat is not None and heartbeat < stale_before:
            return Action(row.replica_id, S.LOST, "agent heartbeat stale", job_update=job_update)
        if row.node != fields["node"] or ("gpus" in fields and row.gpus != fields["gpus"]):
            return Action(row.replica_id, None, None, fields, job_update)
        return None
    if job.state in ENDED_STATES:
        job_update["ended_at"] = now
        if state is S.DRAINING:
            return Action(row.replica_id, S.STOPPED, f"job {job.state}", job_update=job_update)
        return Action(row.replica_id, S.FAILED, f"job {job.state}", job_update=job_update)
    return None


def observe(
    rows: Sequence[ReplicaRow],
    jobs: Mapping[str, JobInfo],
    *,
    stale_before: datetime,
    now: datetime,
) -> list[Action]:
    actions: list[Action] = []
    for row in rows:
        state = S(row.state)
        if row.job_id is None:
            created = _aware(row.created_at) or now
            if state is S.CREATING and now - created > CREATING_GRACE:
                actions.append(Action(row.replica_id, S.FAILED, "never submitted"))
            continue
        job = jobs.get(row.job_id)
        if job is not None:
            act = _for_job(row, job, stale_before, now)
            if act is not None:
                actions.append(act)
            continue
        updated = _aware(row.updated_at) or now
        if state is S.DRAINING:
            actions.append(Action(row.replica_id, S.STOPPED, "job ended"))
        elif state is not S.LOST and now - updated > VANISH_GRACE:
            actions.append(Action(row.replica_id, S.LOST, "job no longer in squeue"))
    return actions
