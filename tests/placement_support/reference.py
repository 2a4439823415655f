"""The placement rules as a plain loop: slow, obviously correct, the yardstick for the strategies.

Used by the tests (100% agreement on random snapshots) and by ``bench/placement.py``; it reads
the node views (``snapshot.nodes``) only. Keep it
boring: no numpy, no caching, no cleverness.
"""

from __future__ import annotations

from collections.abc import Callable

from xhpc.errors import ConfigError
from xhpc.placement.request import (
    Placement,
    PlacementRequest,
    is_candidate,
    pick_reason,
    placement_error,
)
from xhpc.placement.snapshot import ClusterSnapshot, NodeView, SnapshotView

# (tainted, free or -free, not holding the weights locally, load, name)
SortKey = tuple[bool, int, bool, float, str]


def _idle_first(node: NodeView, free: int, local: bool) -> SortKey:
    return (node.tainted, -free, not local, node.load, node.name)


def _pack(node: NodeView, free: int, local: bool) -> SortKey:
    return (node.tainted, free, not local, 0.0, node.name)


REFERENCE_KEYS: dict[str, Callable[[NodeView, int, bool], SortKey]] = {
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
        best = min(
            fitting, key=lambda node: key(node, free[node.name], node.name in request.local_nodes)
        )
        reason = pick_reason(strategy_name, best.name, free[best.name], request)
        free[best.name] -= request.gpus
        placed.append(
            Placement(
                replica=replica,
                node=best.name,
                gpus=request.gpus,
                gpu_type=request.gpu_type,
                reason=reason,
            )
        )
    return placed
