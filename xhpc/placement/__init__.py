"""Placement (pure logic): a cluster snapshot and strategies that pick nodes.

    build_snapshot(sinfo nodes, squeue jobs, reservations, probes, now=...) -> ClusterSnapshot
    SnapshotBuilder().build(...)   (the same, computing again only what changed since its last)
    get_strategy("idle-first" | "pack").place(snapshot, PlacementRequest(...)) -> list[Placement]
    apply_reservations(snapshot, [reservation]) -> ClusterSnapshot      (cheap: no rebuild)

The snapshot is advisory: Slurm's allocation is authoritative and picks the GPU indexes; a
placement says which node and how many GPUs (``--nodelist`` + ``--gres``). The brute-force
reference the strategies are checked against is test support (tests/placement_support).
"""

from xhpc.placement.arrays import SnapshotArrays
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.node_sets import Topology
from xhpc.placement.request import Placement, PlacementError, PlacementRequest
from xhpc.placement.snapshot import (
    HOLDING_STATES,
    ClusterSnapshot,
    GpuView,
    NodeView,
    SnapshotBuilder,
    SnapshotView,
    apply_reservations,
    arrays_for,
    build_snapshot,
)
from xhpc.placement.strategy import (
    DEFAULT_STRATEGY,
    IdleFirst,
    Pack,
    Strategy,
    get_strategy,
    strategy_names,
)

__all__ = [
    "DEFAULT_STRATEGY",
    "HOLDING_STATES",
    "ClusterSnapshot",
    "GpuView",
    "IdleFirst",
    "NodeView",
    "Pack",
    "Placement",
    "PlacementError",
    "PlacementRequest",
    "SnapshotArrays",
    "SnapshotBuilder",
    "SnapshotView",
    "Strategy",
    "Topology",
    "apply_reservations",
    "arrays_for",
    "build_snapshot",
    "expand_hostlist",
    "get_strategy",
    "strategy_names",
]
