"""PD units in the store: one row per unit; its instances are replica rows with ``pd_unit``."""

from __future__ import annotations

from typing import Any

from sqlmodel import col, select

from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.models import UnitState
from xhpc.records import UnitRecord
from xhpc.states import ACTIVE, check_unit_transition
from xhpc.store.store import Store, as_record, state_event
from xhpc.store.tables import ReplicaRow, UnitRow

LIVE_UNIT = (UnitState.STARTING.value, UnitState.READY.value, UnitState.DEGRADED.value)


def unit_record(row: UnitRow) -> UnitRecord:
    return as_record(UnitRecord, row, index=row.idx)


class Units:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, rows: list[UnitRow]) -> None:
        with self.store.session() as s:
            for row in rows:
                s.add(row)

    def get(self, unit_id: str) -> UnitRow:
        with self.store.session() as s:
            row = s.get(UnitRow, unit_id)
            if row is None:
                raise NotFoundError(f"no PD unit named {unit_id!r}")
            return row

    def of(self, deployment: str, *, live_only: bool = False) -> list[UnitRow]:
        with self.store.session() as s:
            q = select(UnitRow).where(UnitRow.deployment == deployment)
            if live_only:
                q = q.where(col(UnitRow.state).in_(LIVE_UNIT))
            return list(s.exec(q.order_by(col(UnitRow.idx))).all())

    def live(self, *, stopping: bool = False) -> list[UnitRow]:
        """Units not ended (and, with ``stopping``, those being stopped too)."""
        states = (*LIVE_UNIT, UnitState.STOPPING.value) if stopping else LIVE_UNIT
        with self.store.session() as s:
            q = select(UnitRow).where(col(UnitRow.state).in_(states))
            return list(s.exec(q.order_by(col(UnitRow.unit_id))).all())

    def next_index(self, deployment: str) -> int:
        return max((u.idx for u in self.of(deployment)), default=-1) + 1

    def update(self, unit_id: str, **fields: Any) -> UnitRow:
        """Update a unit; a state change is validated (xhpc.states), evented and logged."""
        with self.store.session() as s:
            row = s.get(UnitRow, unit_id)
            if row is None:
                raise NotFoundError(f"no PD unit named {unit_id!r}")
            target = fields.get("state")
            if target is not None and target != row.state:
                check_unit_transition(unit_id, UnitState(row.state), UnitState(target))
                s.add(state_event("unit", unit_id, row.state, target, fields.get("reason")))
            for key, value in fields.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            s.add(row)
            return row

    def instances(self, unit_id: str, *, active_only: bool = False) -> list[ReplicaRow]:
        with self.store.session() as s:
            q = select(ReplicaRow).where(ReplicaRow.pd_unit == unit_id)
            if active_only:
                q = q.where(col(ReplicaRow.state).in_([st.value for st in ACTIVE]))
            return list(s.exec(q.order_by(col(ReplicaRow.replica_id))).all())
