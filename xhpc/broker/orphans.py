"""Orphans (pure): where Slurm, the probes and the replica rows disagree, and what to do about it.

- ``gpu_process``: a process holding GPU memory, seen by a *fresh* probe, whose job is none, not in
  squeue, or ended. xhpc never kills processes it did not start: these are only reported.
- ``job_without_replica``: a pending or running job tagged ``--comment=xhpc:BROKER:DEP:RID`` by
  this broker whose replica has no row, a terminal row, or a row that names another job.
- ``replica_without_job``: a row in CREATING (past the grace), QUEUED, STARTING, READY or DRAINING
  whose job is none, not in squeue, or ended. Rows changed within ``grace_s`` are not judged (the
  squeue view may predate them); LOST rows are already handled.

Scope: only the broker user's jobs tagged with this broker's id are judged (two brokers of one
user never cancel each other's jobs); ``plan_actions`` can narrow cancel/adopt to chosen jobs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Literal

from xhpc.broker.reconcile import ENDED_STATES, PENDING_STATES, RUNNING_STATES
from xhpc.broker.tags import TagKind, read_tag
from xhpc.clock import aware
from xhpc.models import Frozen, JobInfo, ProbeReport, ReplicaState, ReplicaView
from xhpc.settings import OrphanPolicy as OrphanPolicy  # re-exported; configured in [orphans]
from xhpc.states import TERMINAL

S = ReplicaState
ACTIVE_JOB_STATES = frozenset(PENDING_STATES | RUNNING_STATES)
# Rows in these states are expected to have a live job (CREATING only once past the grace).
EXPECT_JOB = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY, S.DRAINING})
DEFAULT_GRACE_S = 30.0


class OrphanKind(StrEnum):
    GPU_PROCESS = "gpu_process"
    JOB_WITHOUT_REPLICA = "job_without_replica"
    REPLICA_WITHOUT_JOB = "replica_without_job"


class GpuProcessOrphan(Frozen):
    """A process on a GPU that no live Slurm job accounts for."""

    kind: Literal[OrphanKind.GPU_PROCESS] = OrphanKind.GPU_PROCESS
    node: str
    gpu: int
    pid: int
    mem_used_mb: float | None = None
    job_id: str | None = None  # the job the probe attributed it to, if any
    probe_age_s: float
    reason: str


class JobOrphan(Frozen):
    """A job tagged as xhpc's that no replica row accounts for."""

    kind: Literal[OrphanKind.JOB_WITHOUT_REPLICA] = OrphanKind.JOB_WITHOUT_REPLICA
    job_id: str
    job_name: str
    job_state: str
    user: str | None = None
    nodes: str | None = None
    deployment: str
    replica_id: str
    row_state: ReplicaState | None = None  # None: no row at all
    row_deployment: str | None = None
    row_job_id: str | None = None
    row_job_active: bool = False  # the row's own job is pending or running in squeue
    reason: str


class ReplicaOrphan(Frozen):
    """An active replica row whose job is gone."""

    kind: Literal[OrphanKind.REPLICA_WITHOUT_JOB] = OrphanKind.REPLICA_WITHOUT_JOB
    replica_id: str
    deployment: str
    state: ReplicaState
    job_id: str | None = None
    job_state: str | None = None
    idle_s: float  # since the row last changed
    reason: str


class OrphanReport(Frozen):
    taken_at: datetime
    probe_ttl_s: float
    grace_s: float
    gpu_processes: tuple[GpuProcessOrphan, ...] = ()
    jobs: tuple[JobOrphan, ...] = ()
    replicas: tuple[ReplicaOrphan, ...] = ()
    unprobed_nodes: tuple[str, ...] = ()  # probe data stale: GPU processes not checked there

    @property
    def count(self) -> int:
        return len(self.gpu_processes) + len(self.jobs) + len(self.replicas)


class ActionKind(StrEnum):
    REPORT = "report"
    CANCEL = "cancel"  # scancel the job
    ADOPT = "adopt"  # point the replica row at the job
    MARK_LOST = "mark-lost"  # move the row to ``target`` (LOST; FAILED/STOPPED where LOST is not)


class OrphanAction(Frozen):
    action: ActionKind
    kind: OrphanKind
    job_id: str | None = None
    replica_id: str | None = None
    node: str | None = None
    pid: int | None = None
    target: ReplicaState | None = None
    reason: str


class AppliedAction(Frozen):
    action: OrphanAction
    applied: bool
    error: str | None = None


class OrphanFixRequest(Frozen):
    """Body of ``POST /v1/orphans/fix``: a policy for this run, optionally narrowed to jobs."""

    policy: OrphanPolicy | None = None
    job_ids: tuple[str, ...] | None = None  # None: every job orphan; else only these


class OrphanFixResult(Frozen):
    report: OrphanReport
    actions: tuple[AppliedAction, ...] = ()

    @property
    def unresolved(self) -> int:
        """Orphans left as they were: reported only, or an action that failed."""
        return sum(1 for a in self.actions if a.action.action is ActionKind.REPORT or not a.applied)


# -- finding ------------------------------------------------------------------------------------


def parse_tag(comment: str | None, broker_id: str | None = None) -> tuple[str, str] | None:
    """``xhpc:BROKER:DEPLOYMENT:REPLICA`` -> (deployment, replica_id); None if it is not a
    valid replica tag, or (``broker_id`` given) another broker's. The older
    ``xhpc:DEPLOYMENT:REPLICA`` names no broker and is taken for this one's."""
    tag = read_tag(comment)
    if tag is None or tag.kind is not TagKind.REPLICA or tag.deployment is None:
        return None
    if broker_id is not None and tag.broker is not None and tag.broker != broker_id:
        return None
    return tag.deployment, tag.name


def _job_index(jobs: Sequence[JobInfo]) -> dict[str, JobInfo]:
    """Jobs by id, and by raw numeric id too (a probe may know an array task by either)."""
    return {**{str(j.raw_job_id): j for j in jobs}, **{j.job_id: j for j in jobs}}


def _is_active(job: JobInfo | None) -> bool:
    return job is not None and job.state.upper() in ACTIVE_JOB_STATES


def _gone(job_id: str | None, job: JobInfo | None, missing: str) -> str | None:
    """Why ``job_id`` accounts for nothing any more, or None while its job is still there."""
    if job_id is None:
        return missing
    if job is None:
        return f"job {job_id} is not in squeue"
    if job.state.upper() in ENDED_STATES:
        return f"job {job_id} has ended ({job.state})"
    return None


def _gpu_orphans(
    probes: Mapping[str, ProbeReport], by_id: Mapping[str, JobInfo], now: datetime, ttl_s: float
) -> tuple[list[GpuProcessOrphan], list[str]]:
    found: list[GpuProcessOrphan] = []
    unprobed: list[str] = []
    for node in sorted(probes):
        report = probes[node]
        age_s = max(0.0, (now - aware(report.taken_at)).total_seconds())
        if age_s > ttl_s:
            unprobed.append(node)
            continue
        for gpu in report.gpus:
            for proc in gpu.processes:
                if proc.mem_used_mb == 0:  # holds nothing (the snapshot's rule for foreign)
                    continue
                job = by_id.get(proc.job_id) if proc.job_id is not None else None
                reason = _gone(proc.job_id, job, "no Slurm job")
                if reason is None:
                    continue
                found.append(
                    GpuProcessOrphan(
                        node=node,
                        gpu=gpu.index,
                        pid=proc.pid,
                        mem_used_mb=proc.mem_used_mb,
                        job_id=proc.job_id,
                        probe_age_s=age_s,
                        reason=reason,
                    )
                )
    return found, unprobed


def _job_reason(job: JobInfo, deployment: str, row: ReplicaView | None) -> str | None:
    """Why a tagged active job is an orphan, or None if its row accounts for it."""
    if row is None:
        return "no replica row"
    state = row.state
    if state in TERMINAL:
        return f"replica row is {state.value}"
    if row.deployment != deployment:
        return f"replica row belongs to deployment {row.deployment}"
    if row.job_id == job.job_id:
        return None
    if row.job_id is None:
        # sbatch has returned but the row is not updated yet: a launch in flight.
        return None if state is S.CREATING else "replica row names no job"
    return f"replica row names job {row.job_id}"


def _job_orphans(
    jobs: Sequence[JobInfo],
    rows: Mapping[str, ReplicaView],
    by_id: Mapping[str, JobInfo],
    user: str | None,
    broker_id: str | None,
) -> list[JobOrphan]:
    found: list[JobOrphan] = []
    for job in jobs:
        tag = parse_tag(job.comment, broker_id)
        other_user = user is not None and job.user is not None and job.user != user
        if tag is None or not _is_active(job) or other_user:
            continue
        deployment, replica_id = tag
        row = rows.get(replica_id)
        reason = _job_reason(job, deployment, row)
        if reason is None:
            continue
        row_job = row.job_id if row is not None else None
        found.append(
            JobOrphan(
                job_id=job.job_id,
                job_name=job.name,
                job_state=job.state,
                user=job.user,
                nodes=job.nodes,
                deployment=deployment,
                replica_id=replica_id,
                row_state=row.state if row is not None else None,
                row_deployment=row.deployment if row is not None else None,
                row_job_id=row_job,
                row_job_active=row_job is not None and _is_active(by_id.get(row_job)),
                reason=reason,
            )
        )
    return sorted(found, key=lambda o: (o.deployment, o.replica_id, o.job_id))


def _replica_orphans(
    rows: Iterable[ReplicaView], by_id: Mapping[str, JobInfo], now: datetime, grace_s: float
) -> list[ReplicaOrphan]:
    found: list[ReplicaOrphan] = []
    for row in rows:
        state = row.state
        idle_s = (now - row.updated_at).total_seconds()
        if state not in EXPECT_JOB or idle_s < grace_s:
            continue
        job = by_id.get(row.job_id) if row.job_id is not None else None
        missing = "never submitted" if state is S.CREATING else "no job recorded"
        reason = _gone(row.job_id, job, missing)
        if reason is None:
            continue
        found.append(
            ReplicaOrphan(
                replica_id=row.replica_id,
                deployment=row.deployment,
                state=state,
                job_id=row.job_id,
                job_state=job.state if job is not None else None,
                idle_s=idle_s,
                reason=reason,
            )
        )
    return sorted(found, key=lambda o: (o.deployment, o.replica_id))


def find_orphans(
    jobs: Sequence[JobInfo],
    replicas: Iterable[ReplicaView],
    probes: Mapping[str, ProbeReport],
    *,
    now: datetime,
    probe_ttl_s: float,
    grace_s: float = DEFAULT_GRACE_S,
    user: str | None = None,
    broker_id: str | None = None,
) -> OrphanReport:
    """Every orphan of the three kinds. ``replicas`` must include terminal rows (a job whose row
    is STOPPED is an orphan); ``user``, when given, limits job orphans to that user's jobs, and
    ``broker_id`` to the jobs this broker tagged (other brokers' are theirs to judge)."""
    rows = list(replicas)
    by_id = _job_index(jobs)
    gpu, unprobed = _gpu_orphans(probes, by_id, now, probe_ttl_s)
    return OrphanReport(
        taken_at=now,
        probe_ttl_s=probe_ttl_s,
        grace_s=grace_s,
        gpu_processes=tuple(gpu),
        jobs=tuple(_job_orphans(jobs, {r.replica_id: r for r in rows}, by_id, user, broker_id)),
        replicas=tuple(_replica_orphans(rows, by_id, now, grace_s)),
        unprobed_nodes=tuple(unprobed),
    )


# -- deciding -----------------------------------------------------------------------------------


def lost_target(state: ReplicaState) -> ReplicaState:
    """Where ``mark-lost`` moves a row: the state machine has no CREATING -> LOST, and a
    DRAINING replica whose job is gone has simply stopped."""
    if state is S.CREATING:
        return S.FAILED
    if state is S.DRAINING:
        return S.STOPPED
    return S.LOST


def _adoptable(orphan: JobOrphan) -> bool:
    """A live row of the same replica whose own job (if any) is no longer pending or running."""
    return (
        orphan.row_state is not None
        and orphan.row_state not in TERMINAL
        and orphan.row_deployment == orphan.deployment
        and not orphan.row_job_active
    )


def _job_action(orphan: JobOrphan, policy: OrphanPolicy, chosen: bool) -> OrphanAction:
    mode = policy.job_without_replica if chosen else "report"
    action, reason = ActionKind.REPORT, orphan.reason
    if mode == "cancel":
        action, reason = ActionKind.CANCEL, f"cancel: {orphan.reason}"
    elif mode == "adopt" and _adoptable(orphan):
        action = ActionKind.ADOPT
        reason = f"adopt: replica {orphan.replica_id} now runs as job {orphan.job_id}"
    elif mode == "adopt":
        reason = f"not adoptable: {orphan.reason}"
    return OrphanAction(
        action=action,
        kind=OrphanKind.JOB_WITHOUT_REPLICA,
        job_id=orphan.job_id,
        replica_id=orphan.replica_id,
        reason=reason,
    )


def plan_actions(
    report: OrphanReport, policy: OrphanPolicy, *, job_ids: Collection[str] | None = None
) -> list[OrphanAction]:
    """One action per orphan, in report order. ``job_ids`` narrows cancel/adopt to those jobs
    (the others are reported)."""
    actions = [
        OrphanAction(
            action=ActionKind.REPORT,
            kind=OrphanKind.GPU_PROCESS,
            job_id=o.job_id,
            node=o.node,
            pid=o.pid,
            reason=f"{o.reason}; xhpc never kills processes it did not start",
        )
        for o in report.gpu_processes
    ]
    for job in report.jobs:
        actions.append(_job_action(job, policy, job_ids is None or job.job_id in job_ids))
    for rep in report.replicas:
        mark = policy.replica_without_job == "mark-lost"
        actions.append(
            OrphanAction(
                action=ActionKind.MARK_LOST if mark else ActionKind.REPORT,
                kind=OrphanKind.REPLICA_WITHOUT_JOB,
                job_id=rep.job_id,
                replica_id=rep.replica_id,
                target=lost_target(rep.state) if mark else None,
                reason=rep.reason,
            )
        )
    return actions
