"""PD units as the broker runs them: one hetjob per unit, its state from its instances', and a
degraded unit replaced as a whole (a running hetjob cannot gain or swap a component)."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping

from xhpc.broker.launcher import (
    SCRIPT_FILE,
    _rows,
    _write_replica_dir,
    cancel_quietly,
    current_user,
    submit_tagged,
    write_private,
)
from xhpc.broker.lifecycle import Lifecycle
from xhpc.broker.pd_planner import PdPlan
from xhpc.broker.units import unit_state
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import JobInfo, ReplicaState, Reservation, UnitState
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import DeploymentRow, Store
from xhpc.store.tables import UnitRow
from xhpc.store.units import Units

log = logging.getLogger(__name__)
S = ReplicaState
U = UnitState
Replace = Callable[[str], Awaitable[None]]  # launch one new unit of this deployment


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
    def __init__(
        self, config: XhpcConfig, store: Store, slurm: SlurmClient, lifecycle: Lifecycle
    ) -> None:
        self.config = config
        self.store = store
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.units = Units(store)
        self.user = current_user()

    async def launch(self, plan: PdPlan, new_deployment: DeploymentRow | None) -> None:
        """Record every unit (instances CREATING, GPUs reserved), then one sbatch per unit. No
        partial launch: if an sbatch fails, the units already submitted are cancelled."""
        now = utcnow()
        instances = [i for u in plan.units for i in u.instances]
        tokens = {i.replica_id: secrets.token_urlsafe(32) for i in instances}
        engine_secrets = {i.replica_id: secrets.token_urlsafe(32) for i in instances}
        rows = _rows(instances, plan.name, plan.engine.value, tokens, engine_secrets, now)
        unit_of = {i.replica_id: u.unit_id for u in plan.units for i in u.instances}
        for row in rows:
            row.pd_unit = unit_of[row.replica_id]
        reservations = [
            Reservation(replica_id=i.replica_id, node=i.node, gpus=i.sbatch.gpus, created_at=now)
            for i in instances
            if i.node is not None
        ]
        if new_deployment is not None:
            self.store.create_deployment(new_deployment, rows, reservations)
        else:
            self.store.add_replicas(plan.name, rows, reservations)
        self.units.add(
            [
                UnitRow(
                    unit_id=u.unit_id,
                    deployment=plan.name,
                    idx=u.index,
                    spec=str(plan.request.pd),
                    state=U.STARTING.value,
                    created_at=now,
                    updated_at=now,
                )
                for u in plan.units
            ]
        )
        for i in instances:
            _write_replica_dir(
                i.replica_dir,
                i.spec.model_dump_json(),
                tokens[i.replica_id],
                secret=engine_secrets[i.replica_id],
            )
        submitted: list[str] = []
        for u in plan.units:
            u.unit_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(u.unit_dir, 0o700)
            script = u.unit_dir / SCRIPT_FILE
            write_private(script, u.script)
            try:
                job_id = await submit_tagged(self.slurm, script, u.sbatch.comment, self.user)
            except SlurmError as err:
                await self._abort(plan, submitted, f"sbatch failed: {err.one_line()}")
                raise
            submitted.append(job_id)
            self.units.update(u.unit_id, job_id=job_id)
            for het, i in enumerate(u.instances):
                msg = f"unit {u.unit_id} submitted"
                self.store.transition(i.replica_id, S.QUEUED, msg, job_id=f"{job_id}+{het}")
            log.info("PD unit %s submitted as hetjob %s", u.unit_id, job_id)

    async def _abort(self, plan: PdPlan, job_ids: list[str], reason: str) -> None:
        await cancel_quietly(self.slurm, job_ids)
        for u in plan.units:
            self.units.update(u.unit_id, state=U.ENDED.value, reason=reason)
            for i in u.instances:
                self.lifecycle.move(self.store.replica(i.replica_id), S.FAILED, reason)

    def ready_units(self) -> set[str]:
        return {u.unit_id for u in self.units.live() if u.state == U.READY.value}

    async def reconcile(self, replace: Replace) -> None:
        """Each live unit's state from its instances'; a degraded unit's hetjob is cancelled
        (its live instances drain with it) and, by the site's policy, a new unit replaces it."""
        for unit in self.units.live(stopping=True):
            state, reason = unit_state(self.units.instances(unit.unit_id))
            if unit.state == U.STOPPING.value and state is not U.ENDED:
                continue  # being stopped on purpose: not degraded, just not ended yet
            if state.value == unit.state and reason == unit.reason:
                continue
            self.units.update(unit.unit_id, state=state.value, reason=reason)
            if state is U.DEGRADED:
                log.warning("PD unit %s degraded (%s): replacing it", unit.unit_id, reason)
                await self.end(unit, f"degraded: {reason}")
                if self.config.pd.replace_degraded:
                    await replace(unit.deployment)

    async def end(self, unit: UnitRow, reason: str) -> None:
        """Cancel the unit's hetjob; its instances that still run drain and stop."""
        for row in self.units.instances(unit.unit_id, active_only=True):
            lost = S(row.state) is S.LOST
            self.lifecycle.move(row, S.FAILED if lost else S.DRAINING, reason)
        if unit.job_id is not None:
            await cancel_quietly(self.slurm, [unit.job_id])
        self.units.update(unit.unit_id, state=U.ENDED.value, reason=reason)
