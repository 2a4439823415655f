"""The snapshot's views (pure, frozen): a GPU, a node, the cluster, as placement sees them.

Built by :func:`xhpc.placement.snapshot.build_snapshot`; see that module for what each source
decides.

A snapshot from ``build_snapshot`` builds its node views when they are first read: a placement
decision reads only the numpy arrays (:mod:`xhpc.placement.arrays`), which the build fills in
directly, and 10k nodes x 8 GPUs of views cost more than the rest of the build. Until then the
``nodes`` field is absent from the model's ``__dict__`` and the snapshot keeps a
:class:`NodeSource` aside (:mod:`xhpc.placement.sources`); the first read of ``nodes``
(attribute access, dump, comparison, hash, repr, iteration, copy, pickle) builds every view and
stores the tuple, after which the snapshot is an ordinary model, equal field for field to one
built eagerly (tests/unit/test_placement_ingest.py, test_placement_deferred.py).
:meth:`ClusterSnapshot.node` builds only the one node's view. Code outside this package sees no
difference, as long as it does not read ``__dict__`` or ``vars()`` of a snapshot directly.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from xhpc.models import Frozen

#: Job states in which a job holds its nodes' resources.
HOLDING_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
    }
)


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


class NodeSource(Protocol):
    """What a snapshot's node views are built from until they are read (see the module doc)."""

    def node(self, name: str) -> NodeView | None:
        """The view of the node called ``name`` (the same object :meth:`all` will hold)."""

    def all(self) -> tuple[NodeView, ...]:
        """Every node's view, in name order."""


class ClusterSnapshot(Frozen):
    """Every node, sorted by name; ages of the sources it was built from."""

    taken_at: datetime
    nodes: tuple[NodeView, ...] = ()
    probe_ttl_s: float = 30.0
    sinfo_age_s: float | None = None
    squeue_age_s: float | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSnapshot:
        names = Counter(n.name for n in self.nodes)
        if len(names) != len(self.nodes):
            dup = sorted(name for name, count in names.items() if count > 1)
            raise ValueError(f"duplicate node names in snapshot: {', '.join(dup[:5])}")
        return self

    def node(self, name: str) -> NodeView | None:
        """The node called ``name``: a linear scan, or only that view built (a deferred one)."""
        if "nodes" not in self.__dict__:
            source = _DEFERRED.get(id(self))
            if source is not None:
                return source.node(name)
        return next((n for n in self.nodes if n.name == name), None)

    # -- deferred views: every way pydantic reads the fields builds them first -------------------
    if not TYPE_CHECKING:

        def __getattr__(self, item: str) -> Any:
            if item == "nodes":  # not in __dict__ yet: deferred
                return _build_views(self)
            return super().__getattr__(item)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> Any:
        _build_views(self)
        return handler(self)

    def __eq__(self, other: object) -> bool:
        _build_views(self)
        if isinstance(other, ClusterSnapshot):
            _build_views(other)
        return super().__eq__(other)

    def __hash__(self) -> int:  # as pydantic hashes a frozen model
        _build_views(self)
        fields = self.__dict__
        return hash(tuple(fields[name] for name in _FIELDS))

    def __iter__(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        _build_views(self)
        yield from super().__iter__()

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        _build_views(self)
        return super().__repr_args__()

    def __getstate__(self) -> dict[Any, Any]:
        _build_views(self)
        return super().__getstate__()

    def __copy__(self) -> ClusterSnapshot:
        _build_views(self)
        return super().__copy__()

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> ClusterSnapshot:
        _build_views(self)
        return super().__deepcopy__(memo)


_DEFERRED: dict[int, NodeSource] = {}
_DEFER_LOCK = threading.Lock()


def defer_nodes(snapshot: ClusterSnapshot, source: NodeSource) -> None:
    """Let ``snapshot`` (built without the ``nodes`` field) take its views from ``source``."""
    key = id(snapshot)
    with _DEFER_LOCK:
        if "nodes" in snapshot.__dict__ or key in _DEFERRED:
            raise ValueError("defer_nodes: the snapshot has its nodes already")
        _DEFERRED[key] = source
        weakref.finalize(snapshot, _DEFERRED.pop, key, None)


def deferred_source(snapshot: ClusterSnapshot) -> NodeSource | None:
    """The source of ``snapshot``'s views while they are not built yet, else None."""
    return None if "nodes" in snapshot.__dict__ else _DEFERRED.get(id(snapshot))


def _build_views(snapshot: ClusterSnapshot) -> tuple[NodeView, ...]:
    """``snapshot.nodes``, built now from its source if they were deferred."""
    fields = snapshot.__dict__
    if "nodes" in fields:
        return fields["nodes"]  # type: ignore[no-any-return]
    source = _DEFERRED.get(id(snapshot))
    if source is None:  # (built by another thread meanwhile)
        return snapshot.__dict__["nodes"]  # type: ignore[no-any-return]
    nodes = source.all()  # (not under the lock: 10k nodes take a while)
    with _DEFER_LOCK:
        fields = snapshot.__dict__
        if "nodes" not in fields:  # in declaration order, as a validated model has them
            done = {name: nodes if name == "nodes" else fields[name] for name in _FIELDS}
            object.__setattr__(snapshot, "__dict__", done)
            _DEFERRED.pop(id(snapshot), None)
    return snapshot.__dict__["nodes"]  # type: ignore[no-any-return]


_FIELDS = tuple(ClusterSnapshot.model_fields)
