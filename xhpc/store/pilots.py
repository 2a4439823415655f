"""Pilot jobs in the store: one row per pilot, its replicas point at it (``pilot_id``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import col, select

from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.models import PilotState, PilotView
from xhpc.records import PilotRecord
from xhpc.states import ACTIVE, check_pilot_transition
from xhpc.store.store import Store, as_record, indexes, indexes_text, state_event
from xhpc.store.tables import PilotRow, ReplicaRow

LIVE_PILOT = (PilotState.PENDING.value, PilotState.RUNNING.value)


def pilot_record(row: PilotRow) -> PilotRecord:
    return as_record(PilotRecord, row, devices=indexes(row.devices))


class Pilots:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, row: PilotRow) -> None:
        with self.store.session() as s:
            s.add(row)

    def get(self, pilot_id: str) -> PilotRow:
        with self.store.session() as s:
            row = s.get(PilotRow, pilot_id)
            if row is None:
                raise NotFoundError(f"no pilot named {pilot_id!r}")
            return row

    def live(self) -> list[PilotRow]:
        """Pilots whose job is pending or running (not being cancelled, not ended)."""
        with self.store.session() as s:
            q = select(PilotRow).where(col(PilotRow.state).in_(LIVE_PILOT))
            return list(s.exec(q.order_by(col(PilotRow.pilot_id))).all())

    def not_ended(self) -> list[PilotRow]:
        with self.store.session() as s:
            q = select(PilotRow).where(PilotRow.state != PilotState.ENDED.value)
            return list(s.exec(q.order_by(col(PilotRow.pilot_id))).all())

    def live_on(self, node: str, exclude: str | None = None) -> PilotRow | None:
        """The live pilot on ``node`` (not ``exclude``: a pilot whose time is running out)."""
        return next((p for p in self.live() if p.node == node and p.pilot_id != exclude), None)

    def update(self, pilot_id: str, **fields: Any) -> PilotRow:
        """Update a pilot; a state change is validated (xhpc.states), evented and logged."""
        with self.store.session() as s:
            row = s.get(PilotRow, pilot_id)
            if row is None:
                raise NotFoundError(f"no pilot named {pilot_id!r}")
            target = fields.get("state")
            if target is not None and target != row.state:
                check_pilot_transition(pilot_id, PilotState(row.state), PilotState(target))
                s.add(state_event("pilot", pilot_id, row.state, target, fields.get("reason")))
            for key, value in fields.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            s.add(row)
            return row

    def heard(self, pilot_id: str, devices: Sequence[int], state: PilotState | None = None) -> None:
        """Record its agent's heartbeat: the devices its job sees, the time, a new state."""
        fields: dict[str, Any] = {"devices": indexes_text(devices), "last_heartbeat": utcnow()}
        if state is not None:
            fields["state"] = state.value
        self.update(pilot_id, **fields)

    def replicas(self, pilot_id: str, *, active_only: bool = True) -> list[ReplicaRow]:
        with self.store.session() as s:
            q = select(ReplicaRow).where(ReplicaRow.pilot_id == pilot_id)
            if active_only:
                q = q.where(col(ReplicaRow.state).in_([st.value for st in ACTIVE]))
            return list(s.exec(q.order_by(col(ReplicaRow.replica_id))).all())

    def view(self, pilot: PilotRecord) -> PilotView:
        return PilotView(
            pilot_id=pilot.pilot_id,
            node=pilot.node,
            gpus=pilot.gpus,
            state=pilot.state,
            job_id=pilot.job_id,
            devices=pilot.devices,
            replicas=tuple(r.replica_id for r in self.replicas(pilot.pilot_id)),
        )

    def next_id(self) -> str:
        with self.store.session() as s:
            n = len(s.exec(select(PilotRow.pilot_id)).all())
        return f"pilot-{n + 1}"
