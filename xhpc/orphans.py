"""Orphans (foundation): the report and the actions the broker and `xhpc doctor` exchange
(``GET /v1/orphans``, ``POST /v1/orphans/fix``), and what a policy does about each orphan (pure).

The three kinds (GPU processes with no live job, xhpc jobs with no replica, replicas with no job)
and how they are found: :mod:`xhpc.broker.watch.orphans`; the actions are applied by
``xhpc.broker.desks.orphan_desk``. ``plan_actions`` is here so that ``xhpc doctor`` can preview what
``--fix`` would do without importing the broker.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from enum import StrEnum
from typing import Literal

from xhpc.models import Frozen, ReplicaState
from xhpc.settings import OrphanPolicy as OrphanPolicy  # re-exported; configured in [orphans]
from xhpc.states import TERMINAL

S = ReplicaState


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
