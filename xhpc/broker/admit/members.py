"""A deployment's members as continuity sees them (replica views in, frozen members out): its
replicas, or, for a PD deployment, its units, each one member kept whole."""

from __future__ import annotations

from collections.abc import Sequence

from xhpc.broker.plan.continuity import Member
from xhpc.broker.plan.units import unit_state
from xhpc.models import ReplicaState, ReplicaView, UnitState

S = ReplicaState


def member(view: ReplicaView) -> Member:
    return Member(
        replica_id=view.replica_id,
        state=view.state,
        created_at=view.created_at,
        updated_at=view.updated_at,
        node=view.node,
        ready_at=view.ready_at,
        ends_at=view.ends_at,
        successor_of=view.successor_of,
        reason=view.reason,
    )


def unit_member(unit_id: str, rows: Sequence[ReplicaView]) -> Member:
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
        # a failed unit: its failed instance's node (a lost rank's), which its replacement avoids
        node=last.node if failed else None,
        ready_at=max(r for r in ready if r) if all(ready) else None,
        ends_at=min(ends, default=None),
        successor_of=parts[0].successor_of,
        reason=f"{last.replica_id}: {last.reason}" if failed else parts[0].reason,
    )


def members(rows: Sequence[ReplicaView], *, by_unit: bool) -> list[Member]:
    """A deployment's members as continuity sees them: its replicas, or (``by_unit``, a PD
    deployment) its units."""
    if not by_unit:
        return [member(r) for r in rows]
    units: dict[str, list[ReplicaView]] = {}
    for r in rows:
        if r.unit is not None:
            units.setdefault(r.unit, []).append(r)
    return [unit_member(u, parts) for u, parts in sorted(units.items())]
