"""The broker's side of pilot jobs: heartbeats and orders, releases, and the pilots' own jobs.

A pilot ends when its job ends (time limit, scancel, node failure: its replicas follow through
the ordinary reconcile, their job is the pilot's) or when it has no replica left: then xhpc
cancels its job, so an empty pilot never holds GPUs; unless the site keeps pilots warm
(``[autoscale] pilot_warm_s``) and an autoscaled deployment pinned to its node is asleep: then
it stays up that long, and the deployment's wake starts in it, with no queue wait.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping

from xhpc.broker.desks.agents import hash_token
from xhpc.broker.plan.desired import asleep
from xhpc.broker.plan.pilots import pilot_orders
from xhpc.broker.watch.reconcile import follow_job
from xhpc.clock import monotonic, utcnow
from xhpc.errors import NotFoundError, SlurmError
from xhpc.models import JobInfo, JobState, PilotOrders, PilotReport, PilotState, PilotView
from xhpc.records import PilotRecord
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store
from xhpc.store.pilots import Pilots, pilot_record

log = logging.getLogger(__name__)
P = PilotState


class PilotDesk:
    def __init__(self, store: Store, slurm: SlurmClient, warm_s: float = 0.0) -> None:
        self.store = store
        self.pilots = Pilots(store)
        self.slurm = slurm
        self.warm_s = warm_s  # an empty pilot kept for asleep deployments (0: never)
        self._empty_since: dict[str, float] = {}  # pilot id -> when it was found empty, kept
        # DRAINING replicas in pilots whose drain is over: the pilot may stop them now.
        self.released: set[str] = set()

    def release(self, replica_id: str) -> None:
        self.released.add(replica_id)

    def live_on(self, node: str, exclude: str | None = None) -> PilotRecord | None:
        """The live pilot on ``node`` (not ``exclude``: a pilot whose time is running out)."""
        return self.pilots.live_on(node, exclude=exclude)

    def _authenticate(self, pilot_id: str, token: str) -> PilotRecord:
        try:
            pilot: PilotRecord | None = self.pilots.get(pilot_id)
        except NotFoundError:
            pilot = None
        expected = pilot.token_hash if pilot is not None else hash_token(token + "x")
        if pilot is None or not hmac.compare_digest(expected, hash_token(token)):
            raise PermissionError("bad pilot token")
        return pilot

    def heartbeat(self, token: str, report: PilotReport) -> PilotOrders:
        pilot = self._authenticate(report.pilot_id, token)
        if pilot.job_id != report.job_id:
            raise PermissionError("heartbeat from a job that is not this pilot's")
        started = P.RUNNING if pilot.state is P.PENDING else None
        self.pilots.heard(pilot.pilot_id, report.devices, started)
        rows = self.pilots.replicas(pilot.pilot_id, active_only=False)
        orders = pilot_orders(report, rows, self.released)
        self.released -= set(orders.stop)
        return orders

    async def reconcile(self, jobs: Mapping[str, JobInfo]) -> None:
        """Follow each pilot's job; cancel the job of a pilot that has no replica left."""
        now = utcnow()
        for row in self.pilots.not_ended_jobs():
            job = jobs.get(row.job_id or "")
            # The one judge of a hosting job's Slurm job (xhpc.broker.watch.reconcile.follow_job). A
            # requeued pilot (its node failed, it was preempted) waits PENDING and runs again
            # later, maybe on another node; its replicas wait QUEUED with it.
            move = follow_job(row, job, now)
            pilot = pilot_record(row)
            if move is not None and move.target is JobState.ENDED:
                self._end(pilot, move.reason or "ended")
                continue
            if job is None:
                continue
            if move is not None:
                self.pilots.transition(pilot.pilot_id, P(move.target.value), move.reason)
            if pilot.state is not P.STOPPING and not self.pilots.replicas(pilot.pilot_id):
                if not self._kept_warm(pilot):
                    await self._cancel(pilot)
            else:
                self._empty_since.pop(pilot.pilot_id, None)

    def _kept_warm(self, pilot: PilotRecord) -> bool:
        """Whether an empty pilot stays up for now: for ``warm_s`` after it was found empty,
        while an autoscaled deployment pinned to its node is asleep (a wake starts in it)."""
        sleepers = sorted(
            d.name for d in self.store.deployments() if asleep(d) and d.pilot_node == pilot.node
        )
        if self.warm_s <= 0 or not sleepers:
            self._empty_since.pop(pilot.pilot_id, None)
            return False
        now = monotonic()
        since = self._empty_since.setdefault(pilot.pilot_id, now)
        if since == now:
            log.info(
                "pilot %s has no replica left: kept warm %g s for %s (asleep)",
                pilot.pilot_id, self.warm_s, ", ".join(sleepers),
            )  # fmt: skip
        return now - since < self.warm_s

    def _not_ended(self) -> list[PilotRecord]:
        return self.pilots.not_ended()

    def _end(self, pilot: PilotRecord, reason: str) -> None:
        log.info("pilot %s ended: %s", pilot.pilot_id, reason)
        self.pilots.transition(pilot.pilot_id, P.ENDED, reason)

    async def _cancel(self, pilot: PilotRecord) -> None:
        assert pilot.job_id is not None
        log.info("pilot %s has no replica left: cancelling job %s", pilot.pilot_id, pilot.job_id)
        try:
            await self.slurm.cancel([pilot.job_id])
        except SlurmError as err:
            log.error("could not cancel pilot job %s: %s", pilot.job_id, err.one_line())
            return
        self.pilots.transition(pilot.pilot_id, P.STOPPING, "no replica left")

    def views(self) -> list[PilotView]:
        return [self.pilots.view(p) for p in self._not_ended()]
