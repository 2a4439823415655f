"""Replica state changes as the broker makes them: validated, evented, reservations released,
counted (a job that starts running, one that goes back to Slurm's queue: xhpc.broker.metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from xhpc.broker.admit.members import members
from xhpc.broker.metrics import BrokerMetrics
from xhpc.changes import NO_CHANGE, ReplicaChange
from xhpc.clock import utcnow
from xhpc.models import ReplicaState, ReplicaView, RestartPolicy
from xhpc.records import DeploymentRecord, ReplicaRecord
from xhpc.states import ACTIVE, can_transition
from xhpc.store import Store

S = ReplicaState
# A replica in one of these holds no promise of GPUs any more.
RELEASE_ON = frozenset({S.STOPPED, S.FAILED, S.LOST})
ENDS = frozenset({S.STOPPED, S.FAILED})
RUNNING = frozenset({S.STARTING, S.READY})  # back to QUEUED from these: Slurm requeued its job


def this_serving(dep: DeploymentRecord, rows: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The replicas of the deployment's current serving: a name served again after it ended
    starts a new history (failures, "ever served", cooldowns of the old one do not count)."""
    return [r for r in rows if r.created_at >= dep.created_at]


class Lifecycle:
    def __init__(self, store: Store, metrics: BrokerMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or BrokerMetrics()

    def move(
        self,
        row: ReplicaRecord,
        target: S,
        reason: str | None = None,
        change: ReplicaChange = NO_CHANGE,
    ) -> None:
        """Move ``row`` towards ``target`` if the state machine allows it; else only apply
        ``change``. QUEUED -> READY passes through STARTING (a fast job can skip a poll)."""
        current = row.state
        if current is target:
            if reason is not None:
                change = change.then(ReplicaChange(reason=reason))
            if change:
                self.store.update_replica(row.replica_id, change)
            return
        if current is S.QUEUED and target is S.READY:
            self.store.transition(row.replica_id, S.STARTING, "job running")
            self._started(row)
            current = S.STARTING
        if can_transition(current, target):
            self.store.transition(row.replica_id, target, reason, change)
            if current is S.QUEUED and target is S.STARTING:
                self._started(row)
            elif current in RUNNING and target is S.QUEUED:
                self.metrics.replaced(row.deployment, "requeue")
            if target in RELEASE_ON:
                self.store.release_reservation(row.replica_id, target.value.lower())
            if target in (S.STOPPED, S.FAILED):
                self.close_if_done(row.deployment)
        elif change:
            self.store.update_replica(row.replica_id, change)

    def _started(self, row: ReplicaRecord) -> None:
        """Its job runs: the queue wait since its submission (when the broker recorded one)."""
        at = self.store.submitted_at(row.replica_id, row.job_id) if row.job_id else None
        if at is not None:
            self.metrics.job_started(row.deployment, (utcnow() - at).total_seconds())

    def close_if_done(self, deployment: str) -> None:
        """A deployment with no active replica ends when nothing will launch another: its
        owner stopped it (it wants none), its policy is never, it failed, or it never served
        (a first start that fails is the user's to see, not to retry)."""
        dep = self.store.get_deployment(deployment)
        if dep.sleeping and dep.wanted == 0:
            return  # asleep by its scaling policy: a call wakes it
        views = self.store.replicas(deployment=deployment)
        serving = this_serving(dep, views)
        if any(r.state in ACTIVE for r in serving):
            return
        # Judged by member (a PD unit whose instance failed failed, though its other one stopped).
        ended = [m for m in members(serving, by_unit=dep.pd is not None) if m.state in ENDS]
        latest = max(ended, key=lambda m: m.updated_at, default=None)
        clean_end = latest is not None and latest.state is S.STOPPED
        if (
            dep.wanted <= 0
            or dep.restart is RestartPolicy.NEVER
            or (dep.restart is RestartPolicy.ON_FAILURE and clean_end)
            or dep.failed_reason is not None
            or not any(r.ready_at is not None for r in serving)
        ):
            self.store.mark_deployment_stopped(deployment)
