"""One shared view of Slurm: `sinfo` and `squeue` at most once per interval, whoever asks.

The number of Slurm calls per interval does not grow with users, replicas or CLI invocations: the
reconcile loop, `xhpc serve` and `xhpc nodes` all read the same cached poll.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from xhpc.clock import monotonic
from xhpc.errors import SlurmError
from xhpc.models import JobInfo, NodeInfo, PartitionInfo
from xhpc.placement import Topology
from xhpc.slurm.client import SlurmClient
from xhpc.slurm.partitions import accounting_enabled

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlurmView:
    nodes: tuple[NodeInfo, ...]
    jobs: tuple[JobInfo, ...]
    taken_at: float  # monotonic

    def age_s(self) -> float:
        return monotonic() - self.taken_at


PARTITIONS_MAX_AGE_S = 60.0  # partitions (limits, access lists) change rarely


class SlurmPoller:
    def __init__(self, slurm: SlurmClient) -> None:
        self.slurm = slurm
        self._view: SlurmView | None = None
        self._lock = asyncio.Lock()
        self.polls = 0
        self._partitions: tuple[list[PartitionInfo] | None, float] | None = None
        self._topology: tuple[Topology | None, float] | None = None
        self._accounting: bool | None = None

    async def partitions(self) -> list[PartitionInfo] | None:
        """The partitions (for admission's limits), cached; None when scontrol fails: the
        checks that need them are then skipped, not failed."""
        cached = self._partitions
        if cached is not None and monotonic() - cached[1] <= PARTITIONS_MAX_AGE_S:
            return cached[0]
        try:
            parts: list[PartitionInfo] | None = await self.slurm.partitions()
        except SlurmError as err:
            log.warning("cannot read partitions (limits not checked): %s", err.one_line())
            parts = None
        self._partitions = (parts, monotonic())
        return parts

    async def topology(self) -> Topology | None:
        """Slurm's tree topology (its leaf switches), cached as the partitions are; None when
        the site has none or scontrol fails (placement then ignores switches)."""
        cached = self._topology
        if cached is not None and monotonic() - cached[1] <= PARTITIONS_MAX_AGE_S:
            return cached[0]
        try:
            leaves = await self.slurm.topology()
            found = Topology.of(leaves) if leaves else None
        except SlurmError as err:
            log.warning("cannot read the topology (switches not honoured): %s", err.one_line())
            found = None
        self._topology = (found, monotonic())
        return found

    async def accounting(self, strict: bool = False) -> bool:
        """Whether the site has accounting (fixed while slurmctld runs: read once). When it
        cannot be read: False, or with ``strict`` the SlurmError (a check must not pass then)."""
        if self._accounting is None:
            try:
                self._accounting = accounting_enabled(await self.slurm.accounting_storage_type())
            except SlurmError as err:
                if strict:
                    raise
                log.warning("cannot read AccountingStorageType: %s", err.one_line())
                return False
        return self._accounting

    def latest(self) -> SlurmView | None:
        """The last view polled, however old (None before the first poll): for answers that
        must not wait on Slurm (`xhpc ps`), the reconcile loop keeps it fresh."""
        return self._view

    async def view(self, max_age_s: float) -> SlurmView:
        """The cached view if younger than ``max_age_s``, else a new poll (shared by waiters)."""
        view = self._view
        if view is not None and view.age_s() <= max_age_s:
            return view
        async with self._lock:
            view = self._view
            if view is not None and view.age_s() <= max_age_s:
                return view  # someone else polled while we waited
            nodes, jobs = await asyncio.gather(self.slurm.nodes(), self.slurm.jobs())
            self.polls += 1
            self._view = SlurmView(tuple(nodes), tuple(jobs), monotonic())
            return self._view
