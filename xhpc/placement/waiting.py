"""Where to queue when nothing fits now (pure): the candidates to ask Slurm about, and the choice.

When no node has the GPUs free, the broker asks Slurm (``sbatch --test-only``, one per candidate,
at most ``placement.estimate_candidates`` of them, together and bounded in time) when a job of the
replica's shape would start on each node the request allows, and pins the replica to the one
expected first: it queues there, with Slurm's pending reason, and the re-planner may still move
it if another node frees first. A candidate Slurm gives no estimate for is left out; with none,
the replica is submitted without a node, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC

import numpy as np

from xhpc.models import StartEstimate
from xhpc.placement.request import PlacementRequest
from xhpc.placement.snapshot import ClusterSnapshot, arrays_for


@dataclass(frozen=True, order=True)
class Candidate:
    """A node, in the partition the job would be submitted to (None: Slurm's default)."""

    node: str
    partition: str | None = None


def queue_candidates(
    snapshot: ClusterSnapshot, request: PlacementRequest, limit: int
) -> list[Candidate]:
    """Up to ``limit`` nodes that could ever hold one replica of ``request`` (usable, in its
    partition, of its GPU type, among its nodes, with at least ``gpus`` GPUs), cleanest and
    least loaded first (the idle-first order), ties by name."""
    if limit <= 0:
        return []
    arrays = arrays_for(snapshot)
    idx = np.flatnonzero(arrays.candidates(request))
    out: list[Candidate] = []
    for i in sorted(idx.tolist(), key=lambda i: int(arrays.idle_rank[i])):
        view = snapshot.node(arrays.names[i])
        if view is None or view.gpus_total < request.gpus:
            continue
        out.append(Candidate(arrays.names[i], request.partition))
        if len(out) == limit:
            break
    return out


def earliest(
    candidates: Sequence[Candidate], estimates: Mapping[Candidate, StartEstimate]
) -> list[tuple[Candidate, StartEstimate]]:
    """The candidates Slurm gave an estimate for, expected start first; equal starts keep the
    candidates' order (the idle-first preference)."""
    rank = {c: i for i, c in enumerate(candidates)}
    known = [(c, estimates[c]) for c in candidates if c in estimates]
    return sorted(known, key=lambda ce: (ce[1].start, rank[ce[0]]))


def spread(ranked: Sequence[tuple[Candidate, StartEstimate]], count: int) -> list[Candidate]:
    """A candidate for each of ``count`` replicas: the earliest first, then the next earliest,
    round the list again when replicas outnumber candidates ([] when none is known)."""
    if not ranked:
        return []
    return [ranked[i % len(ranked)][0] for i in range(count)]


def waiting_reason(candidate: Candidate, estimate: StartEstimate) -> str:
    """What the placement says of its choice, e.g. ``nothing idle; n2 in gpu expected to start
    first at 14:03:27 UTC`` (the partition as Slurm named it in its answer)."""
    part = candidate.partition or estimate.partition
    where = f"{candidate.node} in {part}" if part else candidate.node
    at = estimate.start.astimezone(UTC).strftime("%H:%M:%S")
    return f"nothing idle; {where} expected to start first at {at} UTC"
