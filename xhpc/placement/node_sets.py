"""Replicas that span nodes: which set of nodes each one takes (pure, deterministic).

A replica of ``request.span`` nodes takes ``request.gpus`` GPUs on every node of its set (one
Slurm job over the set: ``--nodes N --gres gpu:G``). The nodes of a set are ranked by the
strategy's own per-node key (``xhpc.placement.strategy``: for idle-first, clean nodes first,
then the most free GPUs, so whole idle nodes come before partly used ones, then those holding
the weights, then the load, then the name), and a set is judged by its members' keys, best
first, compared in order: the best set is the N best candidates.

With Slurm's tree topology (``Topology``: each leaf switch's nodes, from ``topology.conf``) a
set is taken within one leaf switch when one has N candidates: the switch whose best N make
the best set wins. Only when no switch has N candidates does a set span switches (as Slurm's
own tree plugin does, through a common parent). Each replica's picks come off the free counts
before the next is placed, as for one-node replicas; every replica is placed or none is.
With ``request.whole`` (jobs that take whole nodes, ``--exclusive``) only nodes with every
GPU free are candidates, and a chosen node is then taken whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from pydantic import Field

from xhpc.models import Frozen
from xhpc.placement.arrays import IntArray, SnapshotArrays
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.request import Placement, PlacementRequest, placement_error
from xhpc.placement.snapshot import ClusterSnapshot

KeyFn = Callable[[SnapshotArrays, IntArray, IntArray, IntArray], IntArray]


class Topology(Frozen):
    """Slurm's tree topology as placement reads it: each leaf switch and its nodes."""

    leaves: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @classmethod
    def of(cls, leaves: Mapping[str, str]) -> Topology:
        """From each leaf switch's Slurm hostlist (``SlurmClient.topology``)."""
        return cls(leaves={s: tuple(expand_hostlist(nodes)) for s, nodes in leaves.items()})

    def switch_of(self) -> dict[str, str]:
        """Each node's leaf switch (a node listed under two leaves: the first by name)."""
        out: dict[str, str] = {}
        for switch in sorted(self.leaves):
            for node in self.leaves[switch]:
                out.setdefault(node, switch)
        return out


def _groups(arrays: SnapshotArrays, idx: IntArray, topology: Topology | None) -> list[IntArray]:
    """The candidates ``idx`` split by leaf switch (no topology, or a node on no leaf: one
    group of its own kind, "no switch")."""
    if topology is None or not topology.leaves:
        return [idx]
    switch = topology.switch_of()
    by: dict[str | None, list[int]] = {}
    for i in idx.tolist():
        by.setdefault(switch.get(arrays.names[i]), []).append(i)
    return [np.asarray(v, dtype=np.int64) for _, v in sorted(by.items(), key=lambda kv: str(kv[0]))]


def _best_set(
    arrays: SnapshotArrays, idx: IntArray, keys: IntArray, span: int, topology: Topology | None
) -> IntArray | None:
    """The ``span`` candidates that make the best set (head first), or None: too few."""
    if idx.size < span:
        return None
    rank = dict(zip(idx.tolist(), keys.tolist(), strict=True))
    best: tuple[list[int], IntArray] | None = None
    for group in _groups(arrays, idx, topology):
        if group.size < span:
            continue
        order = sorted(group.tolist(), key=lambda i: rank[i])[:span]
        score = [rank[i] for i in order]
        if best is None or score < best[0]:
            best = (score, np.asarray(order, dtype=np.int64))
    if best is not None:
        return best[1]
    return np.asarray(sorted(idx.tolist(), key=lambda i: rank[i])[:span], dtype=np.int64)


def place_sets(
    snapshot: ClusterSnapshot,
    arrays: SnapshotArrays,
    request: PlacementRequest,
    key: KeyFn,
    remote: IntArray,
    why: str,
    topology: Topology | None = None,
) -> list[Placement]:
    """Every replica's node set, or PlacementError (nothing placed)."""
    base = arrays.candidates(request)
    free = arrays.free.copy()
    g, span = request.gpus, request.span
    placed: list[Placement] = []
    for replica in range(request.replicas):
        fits = (free >= arrays.total) if request.whole else (free >= g)
        idx = np.flatnonzero(base & fits & (free >= g))
        chosen = _best_set(arrays, idx, key(arrays, idx, free[idx], remote[idx]), span, topology)
        if chosen is None:
            raise placement_error(snapshot.nodes, request, placed)
        names = tuple(arrays.names[i] for i in chosen.tolist())
        reason = _reason(why, names, free, chosen, request, topology)
        free[chosen] = 0 if request.whole else free[chosen] - g
        placed.append(
            Placement(
                replica=replica,
                node=names[0],
                node_set=names,
                gpus=g,
                gpu_type=request.gpu_type,
                reason=reason,
            )
        )
    return placed


def _reason(
    why: str,
    names: Sequence[str],
    free: IntArray,
    chosen: IntArray,
    request: PlacementRequest,
    topology: Topology | None,
) -> str:
    counts = sorted({int(free[i]) for i in chosen.tolist()})
    shown = "/".join(str(c) for c in counts)
    text = f"{'+'.join(names)}: {why}, {shown} GPU(s) free on each"
    if topology is not None and topology.leaves:
        switch = topology.switch_of()
        leaves = sorted({switch.get(n, "?") for n in names})
        text += (
            f", on switch {leaves[0]}" if len(leaves) == 1 else f", across {len(leaves)} switches"
        )
    held = [n for n in names if n in request.local_nodes]
    if held:
        text += f", {len(held)} of {len(names)} hold {request.model or 'the model'} locally"
    return text
