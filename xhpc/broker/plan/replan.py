"""Re-planning (pure part): which queued replicas waited too long on the node xhpc chose.

A replica xhpc placed (not pinned by the user) whose job has been PENDING for longer than
``placement.replan_after_s`` for a node-related reason is moved: its job is cancelled and
submitted again for another node that fits now (the broker decides with the same strategy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from xhpc.models import JobInfo, ReplicaState, ReplicaView

# Pending reasons that say "not on this node now"; others (priority, dependencies, holds, begin
# times, limits) would follow the job to any node, so moving it would not help.
NODE_REASONS = ("Resources", "ReqNodeNotAvail", "NodeDown", "Reservation", "BadConstraints")


def reason_code(reason: str) -> str:
    """Slurm's reason without its description (``ReqNodeNotAvail, UnavailableNodes:n1``)."""
    return reason.split(", ", 1)[0]


def stuck_on_node(reason: str | None) -> bool:
    return bool(reason) and any(str(reason).startswith(r) for r in NODE_REASONS)


def replan_due(
    rows: Sequence[ReplicaView],
    jobs: Mapping[str, JobInfo],
    submitted_at: Mapping[str, datetime],
    *,
    now: datetime,
    after_s: float,
    max_replans: int,
) -> list[ReplicaView]:
    """The QUEUED replicas to re-plan now (``submitted_at`` is keyed by job id)."""
    due: list[ReplicaView] = []
    for row in rows:
        if row.state is not ReplicaState.QUEUED or row.placed_node is None:
            continue
        if row.job_id is None or row.replans >= max_replans:
            continue
        job = jobs.get(row.job_id)
        since = submitted_at.get(row.job_id)
        if job is None or job.state != "PENDING" or since is None:
            continue
        if stuck_on_node(job.reason) and now - since >= timedelta(seconds=after_s):
            due.append(row)
    return due
