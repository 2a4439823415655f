"""PD units as the broker runs them: one hetjob per unit, its state from its instances', and a
degraded unit ended as a whole (a running hetjob cannot gain or swap a component); the keeper
replaces it with a new unit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from xhpc.broker.desks.launcher import cancel_quietly
from xhpc.broker.plan.units import unit_state
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.models import JobInfo, ReplicaState, UnitState
from xhpc.records import ReplicaRecord, UnitRecord
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store
from xhpc.store.units import Units

log = logging.getLogger(__name__)
S = ReplicaState
U = UnitState


def leader(job_id: str) -> str:
    """The hetjob's id from a component's "JOB+OFFSET" (scancel of it ends the whole unit)."""
    return job_id.split("+", 1)[0]


def with_het_ids(jobs: Mapping[str, JobInfo]) -> dict[str, JobInfo]:
    """Jobs by id, and hetjob components by "LEADER+OFFSET" too (what PD instances record)."""
    out = dict(jobs)
    for job in jobs.values():
        if job.het_job_id is not None and job.het_job_offset is not None:
            out[f"{job.het_job_id}+{job.het_job_offset}"] = job
    return out


class UnitDesk:
    def __init__(self, store: Store, slurm: SlurmClient, lifecycle: Lifecycle) -> None:
        self.store = store
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.units = Units(store)
        # How an instance is drained (the service's): its job is cancelled once its requests
        # are done (None: a degraded unit's hetjob is cancelled at once).
        self.drain: Callable[[ReplicaRecord], None] | None = None

    def live(self, *, stopping: bool = False) -> list[UnitRecord]:
        """Units not ended (and, with ``stopping``, those being stopped too)."""
        return self.units.live(stopping=stopping)

    def ready_units(self) -> set[str]:
        return {u.unit_id for u in self.live() if u.state is U.READY}

    async def reconcile(self) -> None:
        """Each live unit's state from its instances'; a degraded unit's hetjob is cancelled
        (its live instances drain with it). The keeper replaces it by the deployment's restart
        policy (xhpc.broker.keeper), as it replaces any other shape's job."""
        for unit in self.live(stopping=True):
            views = self.units.instances(unit.unit_id)
            state, reason = unit_state(views)
            if unit.state is U.STOPPING and state is not U.ENDED:
                continue  # being stopped on purpose: not degraded, just not ended yet
            if state is unit.state and reason == unit.reason:
                continue
            self.units.transition(unit.unit_id, state, reason)
            if state is U.DEGRADED:
                log.warning("PD unit %s degraded (%s): ending it", unit.unit_id, reason)
                await self.end(unit, f"degraded: {reason}")

    async def end(self, unit: UnitRecord, reason: str) -> None:
        """End the unit: its instances that still run drain (the requests they have in flight
        finish: a stopped engine would end them with no finish), then its hetjob is
        cancelled; at once where none runs."""
        draining = False
        for row in self.units.instances(unit.unit_id, active_only=True):
            lost = row.state is S.LOST
            self.lifecycle.move(row, S.FAILED if lost else S.DRAINING, reason)
            if not lost and row.job_id is not None and self.drain is not None:
                self.drain(row)
                draining = True
        if unit.job_id is not None and not draining:
            await cancel_quietly(self.slurm, [unit.job_id])
        self.units.transition(unit.unit_id, U.ENDED, reason)
