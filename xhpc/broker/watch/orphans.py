"""Finding orphans (pure): where Slurm, the probes and the replica rows disagree.

- ``gpu_process``: a process holding GPU memory, seen by a *fresh* probe, whose job is none, not in
  squeue, or ended. xhpc never kills processes it did not start: these are only reported.
- ``job_without_replica``: a pending or running job tagged ``--comment=xhpc:BROKER:DEP:RID`` by
  this broker whose replica has no row, a terminal row, or a row that names another job.
- ``replica_without_job``: a row in CREATING (past the grace), QUEUED, STARTING, READY or DRAINING
  whose job is none, not in squeue, or ended. Rows changed within ``grace_s`` are not judged (the
  squeue view may predate them); LOST rows are already handled.

Scope: only the broker user's jobs tagged with this broker's id are judged (two brokers of one
user never cancel each other's jobs). The report, the actions and what a policy does about each
orphan (``plan_actions``) are in :mod:`xhpc.orphans`, where the CLI finds them too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

from xhpc.broker.admit.tags import TagKind, read_tag
from xhpc.broker.watch.reconcile import ENDED_STATES, PENDING_STATES, RUNNING_STATES
from xhpc.clock import aware
from xhpc.models import JobInfo, ProbeReport, ReplicaState, ReplicaView
from xhpc.orphans import GpuProcessOrphan, JobOrphan, OrphanReport, ReplicaOrphan
from xhpc.states import TERMINAL

S = ReplicaState
ACTIVE_JOB_STATES = frozenset(PENDING_STATES | RUNNING_STATES)
# Rows in these states are expected to have a live job (CREATING only once past the grace).
EXPECT_JOB = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY, S.DRAINING})
DEFAULT_GRACE_S = 30.0


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
