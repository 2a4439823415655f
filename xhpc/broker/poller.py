"""One shared view of Slurm: `sinfo` and `squeue` at most once per interval, whoever asks.

The number of Slurm calls per interval does not grow with users, replicas or CLI invocations: the
reconcile loop, `xhpc serve` and `xhpc nodes` all read the same cached poll.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from xhpc.clock import monotonic
from xhpc.models import JobInfo, NodeInfo
from xhpc.slurm.client import SlurmClient


@dataclass(frozen=True)
class SlurmView:
    nodes: tuple[NodeInfo, ...]
    jobs: tuple[JobInfo, ...]
    taken_at: float  # monotonic

    def age_s(self) -> float:
        return monotonic() - self.taken_at


class SlurmPoller:
    def __init__(self, slurm: SlurmClient) -> None:
        self.slurm = slurm
        self._view: SlurmView | None = None
        self._lock = asyncio.Lock()
        self.polls = 0

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
