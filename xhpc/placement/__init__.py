"""Placement (pure logic): a cluster snapshot, strategies that pick nodes, a brute-force reference.

    build_snapshot(sinfo nodes, squeue jobs, reservations, probes, now=...) -> ClusterSnapshot
    get_strategy("idle-first" | "pack").place(snapshot, PlacementRequest(...)) -> list[Placement]
    apply_reservations(snapshot, [reservation]) -> ClusterSnapshot      (cheap: no rebuild)
    reference_place(snapshot, request, "idle-first" | "pack")      (slow, for tests and the bench)

The snapshot is advisory: Slurm's allocation is authoritative and picks the GPU indexes; a
placement says which node and how many GPUs (``--nodelist`` + ``--gres``).
"""

from xhpc.placement.arrays import SnapshotArrays, apply_reservations, arrays_for
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.reference import reference_place
from xhpc.placement.request import Placement, PlacementError, PlacementRequest
from xhpc.placement.snapshot import (
    HOLDING_STATES,
    ClusterSnapshot,
    GpuView,
    NodeView,
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
    "Strategy",
    "apply_reservations",
    "arrays_for",
    "build_snapshot",
    "expand_hostlist",
    "get_strategy",
    "reference_place",
    "strategy_names",
]
