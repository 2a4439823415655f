"""A replica whose whole job is gone moves to another node now, not when Slurm notices.

A proxy that cannot connect to a READY replica tells the broker, and the replica goes LOST (out
of every routing table: agents.py). The broker then asks the replica's agent on its liveness
port (docs/decisions/0015-lost-jobs-and-poison-requests.md): a greeting means the job lives and
only its engine did not answer (the agent reports what happened to it). No greeting, asked
twice, means the whole job is gone: its node died or its link went down.

Slurm learns of a dead node only after its ``SlurmdTimeout``; it then requeues the job, which
waits for the node it was pinned to until the re-planner moves it. That is half a minute or
more without the replica. Instead the broker moves it at once, as a re-plan does: the job is
cancelled and submitted again for another node that fits now (never the lost one), and the
replica goes back to QUEUED. When nothing fits elsewhere, or Slurm refuses, the replica stays
LOST and Slurm's requeue takes its course (docs/lifecycle.md).

Only a replica in its own job is moved: a pilot's replicas follow the pilot's job, and a PD
instance is never made LOST by a proxy (its unit ends whole).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence

from xhpc.aio import greeted
from xhpc.broker.desks.replanner import Replanner
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.poller import SlurmPoller
from xhpc.changes import OFF_NODE
from xhpc.models import AGENT_GREETING, ReplicaState
from xhpc.records import ReplicaRecord
from xhpc.store import Store

log = logging.getLogger(__name__)
S = ReplicaState


class LostJobs:
    def __init__(
        self,
        store: Store,
        lifecycle: Lifecycle,
        replanner: Replanner,
        poller: SlurmPoller,
        lock: asyncio.Lock,
        *,
        timeout_s: float = 1.0,
        asks: int = 2,
    ) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.replanner = replanner
        self.poller = poller
        self.lock = lock  # the broker's launch lock: a move submits a job
        self.timeout_s = timeout_s
        self.asks = asks
        self._checking: dict[tuple[str, str], asyncio.Task[None]] = {}

    def suspect(self, rows: Sequence[ReplicaRecord]) -> None:
        """These replicas just went LOST (``rows`` as they were before: with their address):
        ask each one's agent, and move those whose job is gone."""
        for row in rows:
            if row.pilot is not None or row.unit is not None or row.job_id is None:
                continue
            if not row.host or row.agent_port is None:
                continue  # an agent with no liveness port: Slurm's requeue decides
            key = (row.replica_id, row.job_id)
            if key in self._checking:
                continue
            task = asyncio.create_task(self._check(row))
            self._checking[key] = task
            task.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: tuple[str, str], _task: asyncio.Task[None]) -> None:
        self._checking.pop(key, None)

    async def wait(self) -> None:
        """Until the checks under way end (tests, shutdown)."""
        while self._checking:
            await asyncio.gather(*self._checking.values(), return_exceptions=True)

    async def _job_gone(self, host: str, port: int) -> bool:
        for i in range(self.asks):
            if await greeted(host, port, AGENT_GREETING, self.timeout_s):
                return False
            if i + 1 < self.asks:
                await asyncio.sleep(self.timeout_s / 2)
        return True

    async def _check(self, was: ReplicaRecord) -> None:
        assert was.host is not None and was.agent_port is not None
        try:
            if not await self._job_gone(was.host, was.agent_port):
                return
            async with self.lock:
                row = self.store.replica(was.replica_id)
                if row.state is not S.LOST or row.job_id != was.job_id:
                    return  # it came back, or something else moved it meanwhile
                view = await self.poller.view(max_age_s=0.0)
                why = f"job {row.job_id} lost on {row.node or was.node}: its agent does not answer"
                note = await self.replanner.move(row, view, why, replan=False)
                if note is None:
                    log.warning("replica %s: %s; nowhere else to go now", row.replica_id, why)
                    return
                self.lifecycle.move(self.store.replica(row.replica_id), S.QUEUED, note, OFF_NODE)
        except Exception:  # a check must never take the broker down
            log.exception("checking lost replica %s", was.replica_id)
