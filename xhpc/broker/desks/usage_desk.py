"""`xhpc usage`: the keys' token counts joined with the GPU-hours Slurm accounting charged for
the deployments' jobs and the batches' job arrays (xhpc.broker.watch.gpu_hours).

Slurm is asked only about the runs whose figures may still change: a run whose records have all
ended is kept here and never asked again (one `sacct` per batch of the other job ids per report).
Without accounting, or when `sacct` fails, the GPU-hours are None ("n/a"), never a guess.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from xhpc.access import JobCharge, JobUsage, UsageLine
from xhpc.broker.watch.gpu_hours import (
    Runs,
    gpu_hours_by_group,
    is_final,
    join_usage,
    records_by_run,
)
from xhpc.broker.watch.poller import SlurmPoller
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.slurm.client import SlurmClient
from xhpc.store.charges import job_charges
from xhpc.store.keys import Keys
from xhpc.store.store import Store

log = logging.getLogger(__name__)


class UsageDesk:
    def __init__(
        self,
        store: Store,
        keys: Keys,
        slurm: SlurmClient,
        poller: SlurmPoller,
        user: str,
        more_charges: Callable[[], list[JobCharge]] = list,
    ) -> None:
        """``more_charges``: runs outside the store (batches' job arrays)."""
        self.store = store
        self.more_charges = more_charges
        self.keys = keys
        self.slurm = slurm
        self.poller = poller
        self.user = user  # the Unix user the broker submits jobs as
        self._final: dict[str, tuple[JobUsage, ...]] = {}  # run -> records that never change
        self._lock = asyncio.Lock()  # one round of sacct at a time: the next asks fewer ids

    async def lines(self) -> list[UsageLine]:
        """Every usage line (callers narrow them to what the caller may see)."""
        lines = self.keys.usage()
        if not await self.poller.accounting():
            return join_usage(lines, None)
        charges = job_charges(self.store) + self.more_charges()
        runs = await self._runs(charges)
        if runs is None:
            return join_usage(lines, None)
        return join_usage(lines, gpu_hours_by_group(charges, runs))

    async def _runs(self, charges: list[JobCharge]) -> Runs | None:
        """Each run's records: kept ones, and sacct's for the others (None when sacct fails)."""
        async with self._lock:
            todo = [c for c in charges if c.run not in self._final]
            records: list[JobUsage] = []
            if todo:
                try:
                    records = await self.slurm.job_usage([c.job_id for c in todo], self.user)
                except SlurmError as err:
                    log.warning("cannot read Slurm accounting (GPU-hours n/a): %s", err.one_line())
                    return None
            found = records_by_run(todo, records)
            now = utcnow()
            for charge in todo:
                if is_final(charge, found[charge.run], now):
                    self._final[charge.run] = found[charge.run]
            return {**found, **{c.run: self._final[c.run] for c in charges if c.run in self._final}}
