"""The snapshot's views (pure, frozen pydantic models): a GPU, a node, the cluster, as placement
sees them, and what ``GET /v1/nodes`` sends.

:class:`~xhpc.placement.snapshot.ClusterSnapshot` builds them when they are first read (a
placement decision reads only its column arrays); :class:`SnapshotView` is the whole snapshot as
one model (``snapshot.view()``), which the broker sends and ``xhpc nodes`` reads back.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from datetime import datetime

from pydantic import Field, model_validator

from xhpc.models import Frozen


class GpuView(Frozen):
    """One GPU of a node: who holds it in Slurm, and (fresh probes only) what the probe saw."""

    index: int
    slurm_jobs: tuple[str, ...] = ()
    unattributed: bool = False  # Slurm counts it used, no job's IDX names it
    healthy: bool = True
    foreign: bool = False  # GPU memory held by a process with no Slurm job
    util_pct: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    error: str | None = None

    @property
    def allocated(self) -> bool:
        """Held by Slurm (by a known job, or counted used without an index)."""
        return bool(self.slurm_jobs) or self.unattributed

    @property
    def clean(self) -> bool:
        return self.healthy and not self.foreign

    @property
    def idle(self) -> bool:
        """Neither allocated by Slurm nor unhealthy nor holding foreign memory."""
        return not self.allocated and self.clean


class NodeView(Frozen):
    """One node as placement sees it."""

    name: str
    address: str
    state: str
    state_flags: tuple[str, ...] = ()
    reason: str | None = None
    usable: bool
    partitions: tuple[str, ...] = ()
    gpu_type: str | None = None
    gpus: tuple[GpuView, ...] = ()
    reserved: int = Field(default=0, ge=0)
    probe_age_s: float | None = None
    probe_stale: bool = False

    @property
    def gpus_total(self) -> int:
        return len(self.gpus)

    @property
    def allocated(self) -> int:
        return sum(1 for g in self.gpus if g.allocated)

    @property
    def unhealthy(self) -> int:
        return sum(1 for g in self.gpus if not g.healthy)

    @property
    def foreign(self) -> int:
        return sum(1 for g in self.gpus if g.foreign)

    @property
    def idle(self) -> int:
        return sum(1 for g in self.gpus if g.idle)

    @property
    def free(self) -> int:
        """GPUs a new job may get: idle ones less the open reservations on this node."""
        return max(0, self.idle - self.reserved)

    @property
    def tainted(self) -> bool:
        """A fresh probe saw an unhealthy GPU or foreign GPU memory: sort after clean nodes."""
        return any(not g.clean for g in self.gpus)

    @property
    def probe_fresh(self) -> bool:
        return self.probe_age_s is not None and not self.probe_stale

    @property
    def load(self) -> float:
        """0..1: mean of (mean GPU utilisation, mean memory fraction) over what a fresh probe read.

        0.0 when no fresh probe data exists (no evidence of load). Non-finite readings are ignored.
        """
        return node_load(self.gpus)


def node_load(gpus: Iterable[GpuView]) -> float:
    """:attr:`NodeView.load` of these GPUs (the snapshot's arrays compute it the same way)."""
    utils: list[float] = []
    mems: list[float] = []
    for g in gpus:
        util, mem = _fractions(g.util_pct, g.mem_used_mb, g.mem_total_mb)
        if util is not None:
            utils.append(util)
        if mem is not None:
            mems.append(mem)
    return _mean_load(utils, mems)


def _fractions(
    util_pct: float | None, mem_used_mb: float | None, mem_total_mb: float | None
) -> tuple[float | None, float | None]:
    """One GPU's (utilisation, memory) in 0..1; None for what was not read or is not finite."""
    util = None
    if util_pct is not None and math.isfinite(util_pct):
        util = min(max(util_pct / 100.0, 0.0), 1.0)
    mem = None
    if (
        mem_used_mb is not None
        and mem_total_mb is not None
        and math.isfinite(mem_used_mb)
        and math.isfinite(mem_total_mb)
        and mem_total_mb > 0
    ):
        mem = min(max(mem_used_mb / mem_total_mb, 0.0), 1.0)
    return util, mem


def _mean_load(utils: list[float], mems: list[float]) -> float:
    parts = [sum(values) / len(values) for values in (utils, mems) if values]
    return sum(parts) / len(parts) if parts else 0.0


class SnapshotView(Frozen):
    """A snapshot's every node view, sorted by name; ages of the sources it was built from."""

    taken_at: datetime
    nodes: tuple[NodeView, ...] = ()
    probe_ttl_s: float = 30.0
    sinfo_age_s: float | None = None
    squeue_age_s: float | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> SnapshotView:
        names = Counter(n.name for n in self.nodes)
        if len(names) != len(self.nodes):
            dup = sorted(name for name, count in names.items() if count > 1)
            raise ValueError(f"duplicate node names in snapshot: {', '.join(dup[:5])}")
        return self

    def node(self, name: str) -> NodeView | None:
        return next((n for n in self.nodes if n.name == name), None)
