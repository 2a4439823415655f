"""Scaling a deployment to N replicas: which to add, which to drain first (pure parts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xhpc.errors import ValidationError
from xhpc.models import ReplicaState, ReplicaView
from xhpc.records import DeploymentRecord

S = ReplicaState
# Replicas that count towards N. DRAINING ones are leaving; LOST ones have no job to count on.
COUNTED = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY})
# Cheapest to remove first: not yet serving, then serving.
_REMOVAL_RANK = {S.CREATING: 0, S.QUEUED: 0, S.STARTING: 1, S.READY: 2}


def counted(rows: Sequence[ReplicaView]) -> list[ReplicaView]:
    return [r for r in rows if r.state in COUNTED]


def check_scalable(dep: DeploymentRecord, active: Sequence[ReplicaView], target: int) -> None:
    """The eligibility gates, before anything changes."""
    if target < 0:
        raise ValidationError("the number of replicas must be 0 or more")
    if not active and dep.stopped_at is not None:
        raise ValidationError(
            f"deployment {dep.name!r} is not running",
            hint=f"start it with `xhpc serve {dep.model} --name {dep.name}`",
        )


def pick_removals(
    rows: Sequence[ReplicaView], count: int, outstanding: Callable[[str], int]
) -> list[ReplicaView]:
    """The ``count`` replicas to remove: not yet serving first, then the least loaded (fewest
    in-flight requests through the proxies), then the newest."""
    ranked = sorted(
        rows,
        key=lambda r: (_REMOVAL_RANK.get(r.state, 0), outstanding(r.replica_id), -r.index),
    )
    return ranked[: max(0, count)]
