"""Placement strategies: which node each replica goes to (pure, vectorised, deterministic).

Both strategies consider candidate nodes only (usable, in the partition, of the GPU type, among the
listed nodes, with at least ``gpus`` free GPUs) and place the replicas one after another, taking
each pick off a copy of the free counts before the next ("virtual" accounting). Either every
replica is placed or :class:`PlacementError` is raised: there is no partial result. Neither
mutates the snapshot.

Order of preference, first key first:

- :class:`IdleFirst` (default; Xinference's ``IdleFirstLaunchStrategy``): clean nodes before
  tainted ones (a fresh probe saw an unhealthy GPU or foreign GPU memory); most free GPUs; lowest
  probe load (fresh probes only, else 0); node name. Replicas spread: 6 x 2 GPUs over three idle
  4-GPU nodes land 2/2/2. Xinference shuffles candidates against herding; here concurrent
  launches see each other through the reservation ledger instead, and ties go by name so a
  decision is reproducible from its snapshot.
- :class:`Pack` (best fit): clean nodes first; fewest free GPUs that still fit; node name. Keeps
  whole nodes free for large jobs.

Both put, right after the free count, nodes that hold the model's weights on local disk
(``request.local_nodes``, the weights cache) before those that do not: among equally idle
nodes (or equally good fits) the one with the weights wins; free GPUs still come first.

``tests/placement_support/reference.py`` is the same rules written as a plain loop; the
tests and ``bench/placement.py`` check that the two agree on every decision. A replica that
spans nodes (``request.span``) takes a set of nodes ranked by the same keys
(``xhpc.placement.node_sets``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from xhpc.errors import ConfigError
from xhpc.placement.arrays import IntArray, SnapshotArrays
from xhpc.placement.node_sets import Topology, place_sets
from xhpc.placement.request import Placement, PlacementRequest, pick_reason, placement_error
from xhpc.placement.snapshot import ClusterSnapshot, arrays_for

DEFAULT_STRATEGY = "idle-first"

# key(arrays, candidate indexes, their free counts, 1 where a candidate lacks the weights
# locally) -> one int64 per candidate; smallest wins.
KeyFn = Callable[[SnapshotArrays, IntArray, IntArray, IntArray], IntArray]


class Strategy(Protocol):
    @property
    def name(self) -> str: ...

    def place(
        self,
        snapshot: ClusterSnapshot,
        request: PlacementRequest,
        topology: Topology | None = None,
    ) -> list[Placement]: ...


def _idle_first_key(
    arrays: SnapshotArrays, idx: IntArray, free: IntArray, remote: IntArray
) -> IntArray:
    # (tainted, -free, remote, load, name) folded into one integer: idle_rank already orders
    # by (tainted, load, name), and tainted/free/remote dominate it through the multipliers.
    span = arrays.max_gpus + 1
    n = len(arrays.names)
    tainted = arrays.tainted[idx].astype(np.int64)
    return ((tainted * span + (arrays.max_gpus - free)) * 2 + remote) * n + arrays.idle_rank[idx]


def _pack_key(arrays: SnapshotArrays, idx: IntArray, free: IntArray, remote: IntArray) -> IntArray:
    # (tainted, free, remote, name)
    span = arrays.max_gpus + 1
    n = len(arrays.names)
    tainted = arrays.tainted[idx].astype(np.int64)
    return ((tainted * span + free) * 2 + remote) * n + arrays.name_rank[idx]


def _remote(arrays: SnapshotArrays, request: PlacementRequest) -> IntArray:
    """1 per node that does not hold the model locally, 0 per node that does."""
    remote = np.ones(len(arrays.names), dtype=np.int64)
    held = [arrays.index[name] for name in request.local_nodes if name in arrays.index]
    remote[held] = 0
    return remote


def _place(
    snapshot: ClusterSnapshot,
    request: PlacementRequest,
    key: KeyFn,
    name: str,
    topology: Topology | None = None,
) -> list[Placement]:
    arrays = arrays_for(snapshot)
    remote = _remote(arrays, request)
    if request.span > 1:
        why = "best fit" if name == "pack" else "idle"
        return place_sets(snapshot, arrays, request, key, remote, why, topology)
    base = arrays.candidates(request)
    free = arrays.free.copy()
    g = request.gpus
    placed: list[Placement] = []
    for replica in range(request.replicas):
        idx = np.flatnonzero(base & (free >= g))
        if idx.size == 0:
            raise placement_error(snapshot.nodes, request, placed)
        best = int(idx[int(np.argmin(key(arrays, idx, free[idx], remote[idx])))])
        node = arrays.names[best]
        reason = pick_reason(name, node, int(free[best]), request)
        free[best] -= g
        placed.append(
            Placement(replica=replica, node=node, gpus=g, gpu_type=request.gpu_type, reason=reason)
        )
    return placed


class _Keyed:
    """A strategy that is its per-node key: every decision is ``_place`` with it."""

    name: str
    key: KeyFn

    def place(
        self,
        snapshot: ClusterSnapshot,
        request: PlacementRequest,
        topology: Topology | None = None,
    ) -> list[Placement]:
        return _place(snapshot, request, type(self).key, self.name, topology)


class IdleFirst(_Keyed):
    """Least-loaded node first: spread replicas over the idlest clean nodes."""

    name = "idle-first"
    key = staticmethod(_idle_first_key)


class Pack(_Keyed):
    """Best fit: the clean node with the fewest free GPUs that still fits."""

    name = "pack"
    key = staticmethod(_pack_key)


_STRATEGIES: dict[str, Callable[[], Strategy]] = {"idle-first": IdleFirst, "pack": Pack}


def strategy_names() -> tuple[str, ...]:
    return tuple(_STRATEGIES)


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name`` (site config ``placement.strategy``)."""
    factory = _STRATEGIES.get(name)
    if factory is None:
        raise ConfigError(
            f"unknown placement strategy {name!r} (valid: {', '.join(_STRATEGIES)})",
            hint="set the site config's placement strategy to one of the valid names",
        )
    return factory()
