"""Reconcile diff (pure): replicas (domain views) + Slurm's job view -> actions that advance
states. Each action's ``change`` and ``job_update`` are typed changes (xhpc.changes) the store
applies to the replica's row and to its job's run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from xhpc.changes import NO_CHANGE, NO_RUN_CHANGE, OFF_NODE, JobRunChange, ReplicaChange
from xhpc.models import JobInfo, JobState, ReplicaState, ReplicaView
from xhpc.records import JobRecord
from xhpc.states import LIVE_JOB_STATES

S = ReplicaState

PENDING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
RUNNING_STATES = {"RUNNING"}
# A job still in squeue in one of these has left RUNNING but may run again (Slurm requeues
# jobs whose node failed or that were preempted): its replica leaves the routing table at once
# and waits QUEUED. COMPLETING is the job's processes being cleaned up (an end, or a requeue).
LEFT_RUNNING_STATES = {"COMPLETING", "NODE_FAIL", "PREEMPTED", "STOPPED"}
# Of those (and the pending states), a new run of the job: its agents must be the next run's.
# A suspended or stopped job resumes the same run (its agent goes on); a configuring or
# resizing one is whichever run Slurm counts (its restart count says).
SAME_RUN_STATES = {"SUSPENDED", "STOPPED"}
COUNTED_RUN_STATES = {"CONFIGURING", "RESIZING"}
# For jobs Slurm does not requeue (PD units' hetjobs): the end.
FINAL_FOR_OTHERS = {"NODE_FAIL", "PREEMPTED"}
ENDED_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
    "REVOKED",
}
# Replicas that were placed on a node and whose job left it: what requeue takes back to QUEUED.
ON_A_NODE = frozenset({S.STARTING, S.READY, S.LOST})
# What leaving the node clears: the old address must never be routed to again.
# A replica whose job vanished from squeue this long after submission is LOST.
VANISH_GRACE = timedelta(seconds=10)
CREATING_GRACE = timedelta(seconds=120)


@dataclass(frozen=True)
class Action:
    replica_id: str
    target: ReplicaState | None = None
    reason: str | None = None
    change: ReplicaChange = NO_CHANGE
    job_update: JobRunChange = NO_RUN_CHANGE
    # The job the replica had when this was decided: an action for a replica that has moved
    # to another job since (a lost job moved, a re-plan) is stale and is not applied.
    job_id: str | None = None


def job_ends_at(job: JobInfo) -> datetime | None:
    """A running job's end: Slurm's start time plus its time limit (None: no limit known)."""
    if job.start_time is None or not job.time_limit_min:
        return None
    return job.start_time + timedelta(minutes=job.time_limit_min)


def _for_job(
    row: ReplicaView, job: JobInfo, stale_before: datetime | None, now: datetime
) -> Action | None:
    state = row.state
    job_update = JobRunChange(slurm_state=job.state, reason=job.reason)
    ended = job_update.then(JobRunChange(ended_at=now))
    if job.state in LEFT_RUNNING_STATES and job.state != "COMPLETING" and state is S.DRAINING:
        return Action(row.replica_id, S.STOPPED, f"job {job.state}", job_update=ended)
    # Its own job or its pilot's: Slurm requeues those (a PD unit's hetjob it does not).
    requeueable = row.unit is None
    if not requeueable and job.state in FINAL_FOR_OTHERS:
        target = S.STOPPED if state is S.DRAINING else S.FAILED
        return Action(row.replica_id, target, f"job {job.state}", job_update=ended)
    if job.state in PENDING_STATES or job.state in LEFT_RUNNING_STATES:
        if state in ON_A_NODE and requeueable:
            why = f"job {job.state} ({job.reason})" if job.reason else f"job {job.state}"
            off = OFF_NODE
            if job.state in COUNTED_RUN_STATES:
                off = off.then(ReplicaChange(restarts=max(row.restarts, job.restart_count)))
            elif job.state not in SAME_RUN_STATES:
                # Only the job's next run may register: agents of this run are refused now.
                off = off.then(ReplicaChange(restarts=max(row.restarts + 1, job.restart_count)))
            return Action(row.replica_id, S.QUEUED, why, off, job_update)
        reason = job.reason or "Pending"
        if state is S.QUEUED and row.reason != reason and job.state in PENDING_STATES:
            return Action(row.replica_id, S.QUEUED, reason, job_update=job_update)
        return None
    if job.state in RUNNING_STATES:
        node = job.batch_host or job.nodes
        job_update = job_update.then(JobRunChange(node=node, gres_detail=",".join(job.gres_detail)))
        change = ReplicaChange(node=node)
        if job.restart_count > row.restarts:
            change = change.then(ReplicaChange(restarts=job.restart_count))
        if job.gpus_idx and row.pilot is None:
            # Slurm's allocation is authoritative for the GPU indexes.
            change = change.then(ReplicaChange(gpus=tuple(job.gpus_idx)))
        ends = job_ends_at(job)  # a pilot's replicas end with the pilot's job
        if ends is not None:
            change = change.then(ReplicaChange(ends_at=ends))
        if state is S.QUEUED:
            return Action(row.replica_id, S.STARTING, "job running", change, job_update)
        heartbeat = row.last_heartbeat
        stale = stale_before is not None and heartbeat is not None and heartbeat < stale_before
        if state is S.READY and stale:
            return Action(row.replica_id, S.LOST, "agent heartbeat stale", job_update=job_update)
        if _changed(row, change):
            return Action(row.replica_id, None, None, change, job_update)
        return None
    if job.state in ENDED_STATES:
        # A job that reached its time limit ended as planned (it served to its end).
        if state is S.DRAINING or job.state == "TIMEOUT":
            return Action(row.replica_id, S.STOPPED, f"job {job.state}", job_update=ended)
        return Action(row.replica_id, S.FAILED, f"job {job.state}", job_update=ended)
    return None


def _changed(row: ReplicaView, change: ReplicaChange) -> bool:
    """Does ``change`` set anything to a value other than what ``row`` holds?"""
    return any(getattr(row, k) != v for k, v in change.given().items())


def observe(
    rows: Sequence[ReplicaView],
    jobs: Mapping[str, JobInfo],
    *,
    stale_before: datetime | None,
    now: datetime,
) -> list[Action]:
    """``stale_before=None``: heartbeats are not judged (just after a broker start)."""
    actions: list[Action] = []
    for row in rows:
        state = row.state
        if row.job_id is None:
            created = row.created_at
            if state is S.CREATING and now - created > CREATING_GRACE:
                actions.append(Action(row.replica_id, S.FAILED, "never submitted"))
            continue
        job = jobs.get(row.job_id)
        if job is not None:
            act = _for_job(row, job, stale_before, now)
            if act is not None:
                actions.append(replace(act, job_id=row.job_id))
            continue
        updated = row.updated_at
        gone = JobRunChange(ended_at=now)  # its final Slurm state is not known
        if state is S.DRAINING:
            actions.append(
                Action(row.replica_id, S.STOPPED, "job ended", job_update=gone, job_id=row.job_id)
            )
        elif state is not S.LOST and now - updated > VANISH_GRACE:
            why = "job no longer in squeue"
            actions.append(Action(row.replica_id, S.LOST, why, job_update=gone, job_id=row.job_id))
    return actions


# A job Slurm takes back to its queue (requeued, preempted, its node failed): it runs again later.
BACK_IN_QUEUE = (PENDING_STATES | LEFT_RUNNING_STATES) - SAME_RUN_STATES


@dataclass(frozen=True)
class JobMove:
    """Where a jobs-table row goes, and why (the one job state machine, xhpc.states)."""

    target: JobState
    reason: str | None


def follow_job(job: JobRecord, info: JobInfo | None, now: datetime) -> JobMove | None:
    """What Slurm's view of a hosting job means for its row, whatever its kind: it ended (Slurm
    says so, or it left squeue ``VANISH_GRACE`` after its row last changed), or it moved
    between running and waiting in the queue (for a kind that lives in PENDING and RUNNING: a
    unit's live states sum up its instances' instead)."""
    if info is not None and info.state in ENDED_STATES:
        return JobMove(JobState.ENDED, f"job {info.state}")
    if info is None:
        if job.job_id is not None and now - job.updated_at > VANISH_GRACE:
            return JobMove(JobState.ENDED, "job no longer in squeue")
        return None
    follows = {JobState.PENDING, JobState.RUNNING} <= LIVE_JOB_STATES[job.kind]
    if follows and info.state in RUNNING_STATES and job.state is JobState.PENDING:
        return JobMove(JobState.RUNNING, None)
    if follows and info.state in BACK_IN_QUEUE and job.state is JobState.RUNNING:
        return JobMove(JobState.PENDING, f"job {info.state}")
    return None
