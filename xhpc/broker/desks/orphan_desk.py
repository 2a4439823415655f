"""The broker's orphan checks: report the three kinds, and apply the orphan policy."""

from __future__ import annotations

import logging

from xhpc.broker.desks.launcher import adopt_job, current_user
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.orphans import find_orphans
from xhpc.broker.watch.poller import SlurmPoller
from xhpc.broker.watch.probes import ProbeBook
from xhpc.clock import utcnow
from xhpc.errors import XhpcError
from xhpc.orphans import (
    ActionKind,
    AppliedAction,
    OrphanAction,
    OrphanFixRequest,
    OrphanFixResult,
    OrphanReport,
    plan_actions,
)
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store

log = logging.getLogger(__name__)


class OrphanDesk:
    def __init__(
        self,
        config: XhpcConfig,
        store: Store,
        slurm: SlurmClient,
        poller: SlurmPoller,
        probes: ProbeBook,
        lifecycle: Lifecycle,
        broker_id: str | None = None,
    ) -> None:
        self.broker_id = broker_id
        self.config = config
        self.store = store
        self.slurm = slurm
        self.poller = poller
        self.probes = probes
        self.lifecycle = lifecycle

    async def report(self, max_age_s: float | None = None) -> OrphanReport:
        """Orphans of the three kinds (xhpc.broker.watch.orphans) from the shared Slurm view, every
        replica row (terminal ones too) and the probes; only this user's jobs are judged."""
        age_s = self.config.placement.max_view_age_s if max_age_s is None else max_age_s
        view = await self.poller.view(age_s)
        return find_orphans(
            view.jobs,
            self.store.replicas(),
            self.probes.reports(),
            now=utcnow(),
            probe_ttl_s=self.config.placement.probe_ttl_s,
            user=current_user(),
            broker_id=self.broker_id,
        )

    async def fix(self, req: OrphanFixRequest) -> OrphanFixResult:
        """Apply the orphan policy to a fresh view (the caller holds the broker's serve lock)."""
        report = await self.report(max_age_s=0.0)
        planned = plan_actions(report, req.policy or self.config.orphans, job_ids=req.job_ids)
        applied = [await self._apply(act) for act in planned]
        return OrphanFixResult(report=report, actions=tuple(applied))

    async def _apply(self, act: OrphanAction) -> AppliedAction:
        try:
            if act.action is ActionKind.CANCEL and act.job_id:
                await self.slurm.cancel([act.job_id])
            elif act.action is ActionKind.ADOPT and act.replica_id and act.job_id:
                row = self.store.replica(act.replica_id)
                why = f"orphan: adopted job {act.job_id}"
                if not adopt_job(self.store, self.lifecycle, row, act.job_id, why):
                    return AppliedAction(action=act, applied=False, error="state changed")
            elif act.action is ActionKind.MARK_LOST and act.replica_id and act.target:
                row = self.store.replica(act.replica_id)
                self.lifecycle.move(row, act.target, f"orphan: {act.reason}")
                if self.store.replica(act.replica_id).state is not act.target:
                    return AppliedAction(action=act, applied=False, error="state changed")
                if row.job_id:  # its job is gone: its row is closed (final state unknown)
                    self.store.end_job(row.replica_id, row.job_id)
            else:
                return AppliedAction(action=act, applied=False)
        except XhpcError as err:
            log.warning("orphans: %s failed: %s", act.action.value, err.one_line())
            return AppliedAction(action=act, applied=False, error=err.one_line())
        log.info("orphans: %s (%s)", act.action.value, act.reason)
        return AppliedAction(action=act, applied=True)
