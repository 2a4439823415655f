"""Re-planning replicas stuck PENDING on the node xhpc chose: cancel, re-render, resubmit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from xhpc.broker.admit.shapes import PARAMS_FILE, SCRIPT_FILE, write_private
from xhpc.broker.desks.launcher import current_user, submit_tagged, submitted_job
from xhpc.broker.metrics import BrokerMetrics
from xhpc.broker.plan.replan import reason_code, replan_due
from xhpc.broker.watch.poller import SlurmView
from xhpc.changes import ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import ReplicaView
from xhpc.placement import (
    ClusterSnapshot,
    PlacementError,
    PlacementRequest,
    Strategy,
    arrays_for,
    expand_hostlist,
)
from xhpc.records import ReplicaRecord
from xhpc.render import SbatchParams, render_sbatch
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store

log = logging.getLogger(__name__)


class Replanner:
    def __init__(
        self,
        config: XhpcConfig,
        store: Store,
        slurm: SlurmClient,
        strategy: Strategy,
        snapshot: Callable[[SlurmView], ClusterSnapshot],
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or BrokerMetrics()
        self.store = store
        self.slurm = slurm
        self.strategy = strategy
        self.snapshot = snapshot
        self.user = current_user()

    async def run(self, view: SlurmView, rows: Sequence[ReplicaRecord]) -> int:
        """Re-plan what is due; returns how many replicas moved."""
        jobs = {j.job_id: j for j in view.jobs}
        replicas = rows
        submitted: dict[str, datetime] = {}
        for r in replicas:
            if r.job_id and (at := self.store.submitted_at(r.replica_id, r.job_id)) is not None:
                submitted[r.job_id] = at
        due = replan_due(
            replicas,
            jobs,
            submitted,
            now=utcnow(),
            after_s=self.config.placement.replan_after_s,
            max_replans=self.config.placement.max_replans,
        )
        moved = 0
        for replica in due:
            reason = reason_code(jobs[str(replica.job_id)].reason or "pending")
            why = f"job {replica.job_id} waited on {replica.placed_node} ({reason})"
            if await self.move(replica, view, why) is not None:
                moved += 1
        return moved

    async def move(
        self, replica: ReplicaView, view: SlurmView, why: str, *, replan: bool = True
    ) -> str | None:
        """Cancel the replica's job and submit it again for another node that fits now (never
        the one it is placed on or ran on); returns the note recorded (``why``, then where
        it went), or None when nothing fits elsewhere or Slurm refused. ``replan``: counts
        against ``placement.max_replans`` (a pending job moved; a lost job's move does not)."""
        dep = self.store.get_deployment(replica.deployment)
        snap = self.snapshot(view)
        allowed = expand_hostlist(dep.nodelist) or arrays_for(snap).names  # no views built
        left = {replica.placed_node, replica.node}
        others = tuple(n for n in allowed if n not in left)
        request = PlacementRequest(
            gpus=dep.gpus,
            partition=dep.partition or self.config.slurm.partition,
            nodes=others,
        )
        if not others:
            return None
        try:
            (target,) = self.strategy.place(snap, request)
        except PlacementError:
            return None  # nothing fits elsewhere now: keep waiting where it is
        rdir = Path(str(replica.replica_dir))
        params = SbatchParams.model_validate_json((rdir / PARAMS_FILE).read_text())
        params = params.model_copy(update={"nodelist": target.node})
        script = rdir / SCRIPT_FILE
        write_private(script, render_sbatch(params))
        write_private(rdir / PARAMS_FILE, params.model_dump_json(indent=2))
        old = str(replica.job_id)
        try:
            await self.slurm.cancel([old])
            job_id = await submit_tagged(self.slurm, script, params.comment, self.user)
        except SlurmError as err:
            log.error("moving %s failed: %s", replica.replica_id, err.one_line())
            return None
        self.store.record_job(submitted_job(job_id, replica.replica_id, script, params.output))
        self.store.end_job(replica.replica_id, old, "CANCELLED")
        note = f"{why}; re-planned to {target.node}"
        self.store.update_replica(
            replica.replica_id,
            ReplicaChange(
                job_id=job_id,
                placed_node=target.node,
                replans=replica.replans + (1 if replan else 0),
                reason=note,
            ),
        )
        self.store.move_reservation(replica.replica_id, target.node, dep.gpus)
        self.store.add_event(
            replica.replica_id, replica.deployment, "replan", f"{note} as job {job_id}"
        )
        log.info("replica %s: %s as job %s", replica.replica_id, note, job_id)
        self.metrics.replaced(replica.deployment, "replan" if replan else "lost")
        return note
