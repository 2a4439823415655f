"""A deployment's members as continuity sees them (rows in, frozen domain values out): its
replicas, or, for a PD deployment, its units, each one member kept whole."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from xhpc.broker.continuity import Member
from xhpc.broker.units import unit_state
from xhpc.clock import utcnow
from xhpc.models import ReplicaState, UnitState
from xhpc.store import DeploymentRow, ReplicaRow

S = ReplicaState


def aware(value: datetime | None) -> datetime | None:
    return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)


def member(row: ReplicaRow) -> Member:
    created = aware(row.created_at) or utcnow()
    return Member(
        replica_id=row.replica_id,
        state=S(row.state),
        created_at=created,
        updated_at=aware(row.updated_at) or created,
        node=row.node,
        ready_at=aware(row.ready_at),
        ends_at=aware(row.ends_at),
        successor_of=row.successor_of,
        reason=row.reason,
    )


def unit_member(unit_id: str, rows: Sequence[ReplicaRow]) -> Member:
    """A PD unit as one member: it serves when every instance does, it failed when one did
    (the unit desk ends a degraded unit whole), it ends at its earliest component's end."""
    parts = [member(r) for r in rows]
    state, _ = unit_state(rows)
    failed = [m for m in parts if m.state in (S.FAILED, S.LOST)]
    if failed:  # the unit desk ends a unit with a failed instance whole
        as_replica = S.FAILED
    elif state is UnitState.READY:
        as_replica = S.READY
    elif state is UnitState.STARTING:
        as_replica = S.STARTING
    elif state is UnitState.STOPPING:
        as_replica = S.DRAINING
    else:
        as_replica = S.STOPPED
    last = max(failed or parts, key=lambda m: m.updated_at)
    ready = [m.ready_at for m in parts]
    ends = [m.ends_at for m in parts if m.ends_at is not None]
    return Member(
        replica_id=unit_id,
        state=as_replica,
        created_at=min(m.created_at for m in parts),
        updated_at=last.updated_at,
        ready_at=max(r for r in ready if r) if all(ready) else None,
        ends_at=min(ends, default=None),
        successor_of=parts[0].successor_of,
        reason=f"{last.replica_id}: {last.reason}" if failed else parts[0].reason,
    )


def members(dep: DeploymentRow, rows: Sequence[ReplicaRow]) -> list[Member]:
    """A deployment's members as continuity sees them: its replicas, or its PD units."""
    if dep.pd is None:
        return [member(r) for r in rows]
    by_unit: dict[str, list[ReplicaRow]] = {}
    for r in rows:
        if r.pd_unit is not None:
            by_unit.setdefault(r.pd_unit, []).append(r)
    return [unit_member(u, parts) for u, parts in sorted(by_unit.items())]
