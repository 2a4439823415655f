"""The placement rules as a plain loop: slow, obviously correct, the yardstick for the strategies.

Used by the tests (100% agreement on random snapshots) and by ``bench/placement.py``; it reads
the node views (``snapshot.nodes``) only. Keep it
boring: no numpy, no caching, no cleverness.
"""

from __future__ import annotations

from collections.abc import Callable

from xhpc.errors import ConfigError
from xhpc.placement.request import Placement, PlacementRequest, is_candidate, placement_error
from xhpc.placement.snapshot import ClusterSnapshot, NodeView, SnapshotView

SortKey = tuple[bool, int, float, str]


def _idle_first(node: NodeView, free: int) -> SortKey:
    return (node.tainted, -free, node.load, node.name)


def _pack(node: NodeView, free: int) -> SortKey:
    return (node.tainted, free, 0.0, node.name)


REFERENCE_KEYS: dict[str, Callable[[NodeView, int], SortKey]] = {
    "idle-first": _idle_first,
    "pack": _pack,
}


def reference_place(
    snapshot: ClusterSnapshot | SnapshotView, request: PlacementRequest, strategy_name: str
) -> list[Placement]:
    """Place every replica in turn on the candidate with the smallest sort key."""
    key = REFERENCE_KEYS.get(strategy_name)
    if key is None:
        raise ConfigError(
            f"unknown placement strategy {strategy_name!r} (valid: {', '.join(REFERENCE_KEYS)})"
        )
    free = {node.name: node.free for node in snapshot.nodes}
    placed: list[Placement] = []
    for replica in range(request.replicas):
        fitting = [
            node
            for node in snapshot.nodes
            if is_candidate(node, request) and free[node.name] >= request.gpus
        ]
        if not fitting:
            raise placement_error(snapshot.nodes, request, placed)
        best = min(fitting, key=lambda node: key(node, free[node.name]))
        free[best.name] -= request.gpus
        placed.append(
            Placement(replica=replica, node=best.name, gpus=request.gpus, gpu_type=request.gpu_type)
        )
    return placed
