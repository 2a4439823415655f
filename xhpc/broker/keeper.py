"""The broker's keeper: applies continuity's decisions (xhpc.broker.plan.continuity) every
reconcile.

It launches replacements and walltime successors through the same planner and launcher as
`xhpc serve`, for every shape (a PD deployment's members are its units, kept whole), retires
predecessors through the drain, gives up on LOST replicas, and fails or ends deployments.
Every action is one structured log line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from xhpc.broker.admit.members import members
from xhpc.broker.plan.continuity import Decision, Desire, decide
from xhpc.broker.plan.desired import stored_request
from xhpc.broker.watch.lifecycle import this_serving
from xhpc.changes import DeploymentChange, ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import XhpcError
from xhpc.models import ReplicaState, ReplicaView, UnitState
from xhpc.records import DeploymentRecord, ReplicaRecord

if TYPE_CHECKING:
    from xhpc.broker.service import BrokerService

log = logging.getLogger(__name__)
S = ReplicaState


def desire(dep: DeploymentRecord) -> Desire:
    return Desire(name=dep.name, wanted=dep.wanted, restart=dep.restart, until_at=dep.until_at)


class Keeper:
    def __init__(self, service: BrokerService) -> None:
        self.svc = service
        # A deployment whose last launch attempt failed before any replica was recorded (the
        # cluster cannot take it now): not tried again before this time, doubling each time.
        self._hold: dict[str, tuple[datetime, float]] = {}

    def kept(self) -> list[DeploymentRecord]:
        """Deployments the keeper looks after: every live one, whatever the shape of its jobs."""
        every = self.svc.store.deployments()
        return [
            d for d in every if d.stopped_at is None and d.failed_reason is None and d.wanted > 0
        ]

    async def run(self) -> None:
        """One pass over every kept deployment (the caller holds the broker's lock)."""
        now = utcnow()
        cfg = self.svc.config.lifecycle
        for dep in self.kept():
            held = self._hold.get(dep.name)
            if held is not None and now < held[0]:
                continue
            views = self.svc.store.replicas(deployment=dep.name)
            serving = this_serving(dep, views)
            those = members(serving, by_unit=dep.pd is not None)
            ever_ready = any(m.ready_at is not None for m in those)
            decision = decide(desire(dep), those, cfg, now, ever_ready=ever_ready)
            if decision.empty:
                continue
            try:
                await self._apply(dep, serving, decision)
                self._hold.pop(dep.name, None)
            except XhpcError as err:
                wait = min(2 * held[1], cfg.backoff_max_s) if held else max(cfg.backoff_s, 1.0)
                self._hold[dep.name] = (now + timedelta(seconds=wait), wait)
                log.warning(
                    "keeper deployment=%s error=%s retry_in_s=%.0f",
                    dep.name,
                    json.dumps(err.one_line()),
                    wait,
                )

    async def _apply(
        self, dep: DeploymentRecord, replicas: Sequence[ReplicaView], d: Decision
    ) -> None:
        svc = self.svc
        by_id = {r.replica_id: r for r in replicas}
        if d.end is not None:
            log.info("keeper deployment=%s action=end reason=%s", dep.name, json.dumps(d.end))
            await svc.stop_deployment(dep.name, d.end)
            return
        if d.fail is not None:
            log.error("keeper deployment=%s action=fail reason=%s", dep.name, json.dumps(d.fail))
            svc.store.update_deployment(dep.name, DeploymentChange(failed_reason=d.fail))
            await svc.stop_deployment(dep.name, "deployment failed")
            return
        for rid in d.expire:
            log.info("keeper deployment=%s action=expire replica=%s", dep.name, rid)
            svc.lifecycle.move(svc.store.replica(rid), S.FAILED, "lost: no word from its job")
            job = by_id[rid].job_id
            if job and by_id[rid].pilot is None:
                await svc.cancel_jobs([job])
        for rid, note in d.notes:
            for row in self._rows_of(dep, rid):
                svc.store.update_replica(row.replica_id, ReplicaChange(reason=note))
        for pred, succ in d.retire:
            log.info(
                "keeper deployment=%s action=retire replica=%s successor=%s", dep.name, pred, succ
            )
            for row in self._rows_of(dep, pred):
                svc.lifecycle.move(row, S.DRAINING, f"handed over to {succ}")
                svc.start_drain(svc.store.replica(row.replica_id))
            if dep.pd is not None:
                svc.unit_desk.units.transition(pred, UnitState.STOPPING)
            svc.metrics.handover(dep.name, "completed")
        for pred in d.successors:
            log.info("keeper deployment=%s action=successor replica=%s", dep.name, pred)
            try:
                await self._launch(dep, 1, d.avoid, successor_of=pred)
            except XhpcError:
                svc.metrics.handover(dep.name, "refused")
                raise
            svc.metrics.handover(dep.name, "started")
        if d.launch:
            log.info(
                "keeper deployment=%s action=replace count=%d avoid=%s",
                dep.name,
                d.launch,
                ",".join(d.avoid) or "-",
            )
            await self._launch(dep, d.launch, d.avoid)
            svc.metrics.replaced(dep.name, "replace", d.launch)

    async def _launch(
        self,
        dep: DeploymentRecord,
        count: int,
        avoid: tuple[str, ...],
        successor_of: str | None = None,
    ) -> None:
        svc = self.svc
        req = stored_request(dep, count)
        # A successor never joins its predecessor's pilot: that job is the one ending.
        ending = None
        if successor_of is not None and dep.pd is None:
            ending = svc.store.replica(successor_of).pilot
        plan = await svc.plan(req, avoid=avoid, not_into=ending)
        await svc.launcher.launch(plan, None)
        if successor_of is not None:
            for r in plan.replicas:
                svc.store.update_replica(r.replica_id, ReplicaChange(successor_of=successor_of))

    def _rows_of(self, dep: DeploymentRecord, member_id: str) -> list[ReplicaRecord]:
        """The live rows of one member: the replica itself, or a PD unit's instances."""
        store = self.svc.store
        if dep.pd is None:
            return [store.replica(member_id)]
        return self.svc.unit_desk.units.instances(member_id, active_only=True)
