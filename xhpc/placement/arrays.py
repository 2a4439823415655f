"""Column arrays of one snapshot, built once, so a placement decision is a few numpy passes (pure).

A decision at 10k nodes x 8 GPUs must take well under 2 ms; a Python loop over the nodes takes
~15 ms. So every per-node quantity a strategy sorts by is prepared here once per snapshot and a
decision only masks, combines into one int64 key and takes ``argmin``:

- ``free``, ``usable``, ``tainted``, ``load``: the :class:`NodeView` properties of those names
  (the same values the brute-force reference reads, so the two agree exactly);
- ``name_rank``: rank of the node's name in Python's string order (tie-break);
- ``idle_rank``: rank by ``(tainted, load, name)``, which IdleFirst uses after the free count;
- one boolean mask per partition and per GPU type.

:class:`~xhpc.placement.snapshot.SnapshotBuilder` keeps the per-node values between builds
(:mod:`xhpc.placement.rows`) and makes the arrays of each snapshot (``snapshot.arrays``) with a
few numpy passes; the arrays are read-only, strategies update a copy of ``free``.
:meth:`SnapshotArrays.from_views` computes the same arrays from node views (the tests compare
the two).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from xhpc.placement.request import PlacementRequest
from xhpc.placement.views import NodeView, node_load

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


def frozen(array: NDArray[np.generic]) -> None:
    array.flags.writeable = False


class Columns:
    """Per-node values the placement arrays are made of, gathered node by node in order.

    ``free``, ``usable``, ``tainted`` and ``load`` are the :class:`NodeView` properties of the
    same names; nodes are grouped by partition list and GPU type (few distinct ones).
    """

    __slots__ = (
        "by_gpu_type",
        "by_partitions",
        "free",
        "load",
        "max_gpus",
        "names",
        "tainted",
        "total",
        "usable",
    )

    def __init__(self) -> None:
        self.names: list[str] = []
        self.free: list[int] = []
        self.usable: list[bool] = []
        self.tainted: list[bool] = []
        self.load: list[float] = []
        self.total: list[int] = []
        self.by_partitions: dict[tuple[str, ...], list[int]] = {}
        self.by_gpu_type: dict[str | None, list[int]] = {}
        self.max_gpus = 0

    def add(
        self,
        name: str,
        *,
        free: int,
        usable: bool,
        tainted: bool,
        load: float,
        partitions: tuple[str, ...],
        gpu_type: str | None,
        gpus: int,
    ) -> None:
        i = len(self.names)
        self.names.append(name)
        self.free.append(free)
        self.usable.append(usable)
        self.tainted.append(tainted)
        self.load.append(load)
        self.total.append(gpus)
        group = self.by_partitions.get(partitions)
        if group is None:
            group = self.by_partitions[partitions] = []
        group.append(i)
        group = self.by_gpu_type.get(gpu_type)
        if group is None:
            group = self.by_gpu_type[gpu_type] = []
        group.append(i)
        if gpus > self.max_gpus:
            self.max_gpus = gpus


@dataclass(frozen=True, eq=False)
class SnapshotArrays:
    """Per-node columns of one snapshot, in the snapshot's node order."""

    names: tuple[str, ...]
    index: Mapping[str, int]
    free: IntArray
    usable: BoolArray
    tainted: BoolArray
    load: NDArray[np.float64]
    name_rank: IntArray
    idle_rank: IntArray
    partitions: Mapping[str, BoolArray]
    gpu_types: Mapping[str, BoolArray]
    max_gpus: int
    total: IntArray  # each node's GPUs

    @classmethod
    def from_views(cls, nodes: Iterable[NodeView]) -> SnapshotArrays:
        """The arrays of these node views (one pass over the GPUs): what ``build_snapshot``
        computes without views."""
        columns = Columns()
        for node in nodes:
            idle, dirty, probed = 0, False, False
            for g in node.gpus:
                if not g.healthy or g.foreign:
                    dirty = True
                elif not g.slurm_jobs and not g.unattributed:
                    idle += 1
                if g.util_pct is not None or g.mem_used_mb is not None:
                    probed = True
            columns.add(
                node.name,
                free=max(0, idle - node.reserved),  # NodeView.free
                usable=node.usable,
                tainted=dirty,  # NodeView.tainted
                load=node_load(node.gpus) if probed else 0.0,  # NodeView.load
                partitions=node.partitions,
                gpu_type=node.gpu_type,
                gpus=len(node.gpus),
            )
        names = columns.names
        return cls.from_columns(
            columns, names_sorted=all(a <= b for a, b in itertools.pairwise(names))
        )

    @classmethod
    def from_columns(
        cls, columns: Columns, *, names_sorted: bool, index: Mapping[str, int] | None = None
    ) -> SnapshotArrays:
        """The arrays from per-node values, in the snapshot's node order.

        ``names_sorted``: the node names are in (non-decreasing) string order already, as
        ``build_snapshot`` sorts them, so each node's name rank is its position. ``index``: name
        -> position, if the caller has it already (it is kept, not copied).
        """
        names = tuple(columns.names)
        n = len(names)
        free = np.array(columns.free, dtype=np.int64)
        usable = np.array(columns.usable, dtype=np.bool_)
        tainted = np.array(columns.tainted, dtype=np.bool_)
        load = np.array(columns.load, dtype=np.float64)
        if names_sorted:
            name_rank = np.arange(n, dtype=np.int64)
        else:
            name_rank = np.empty(n, dtype=np.int64)
            name_rank[sorted(range(n), key=names.__getitem__)] = np.arange(n, dtype=np.int64)
        idle_rank = np.empty(n, dtype=np.int64)
        idle_rank[np.lexsort((name_rank, load, tainted))] = np.arange(n, dtype=np.int64)

        members: dict[str, list[int]] = {}
        for parts, idx in columns.by_partitions.items():
            for part in parts:
                members.setdefault(part, []).extend(idx)
        total = np.array(columns.total, dtype=np.int64)
        for array in (free, usable, tainted, load, name_rank, idle_rank, total):
            frozen(array)
        return cls(
            names=names,
            index=dict(zip(names, range(n), strict=True)) if index is None else index,
            free=free,
            usable=usable,
            tainted=tainted,
            load=load,
            name_rank=name_rank,
            idle_rank=idle_rank,
            partitions={key: cls._mask(n, idx) for key, idx in members.items()},
            gpu_types={
                key: cls._mask(n, idx)
                for key, idx in columns.by_gpu_type.items()
                if key is not None
            },
            max_gpus=columns.max_gpus,
            total=total,
        )

    @staticmethod
    def _mask(n: int, indexes: list[int]) -> BoolArray:
        mask = np.zeros(n, dtype=np.bool_)
        mask[indexes] = True
        frozen(mask)
        return mask

    def candidates(self, request: PlacementRequest) -> BoolArray:
        """Usable nodes in the partition, of the GPU type, among the listed nodes (a new array)."""
        mask = self.usable.copy()
        if request.partition is not None:
            part = self.partitions.get(request.partition)
            if part is None:
                return np.zeros_like(mask)
            mask &= part
        if request.gpu_type is not None:
            typed = self.gpu_types.get(request.gpu_type)
            if typed is None:
                return np.zeros_like(mask)
            mask &= typed
        if request.nodes:
            listed = np.zeros_like(mask)
            listed[[self.index[name] for name in request.nodes if name in self.index]] = True
            mask &= listed
        return mask
