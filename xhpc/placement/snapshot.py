"""One cluster snapshot for placement: Slurm's GRES view + open reservations + fresh probes (pure).

Sources and what each one decides:

- ``sinfo --json`` (:class:`NodeInfo`): which nodes exist, their state, partitions, GPU type, GPU
  total and how many GPUs Slurm counts as used. Slurm 22.05 prints ``gres_used`` without ``IDX``,
  so per-GPU use comes from squeue.
- ``squeue --json`` (:class:`JobInfo`): which GPU indexes each job holds. ``gres_detail`` has one
  entry per allocated node, aligned with the job's expanded node list. Only jobs in a state that
  holds resources count (RUNNING, COMPLETING, CONFIGURING, SUSPENDED, ...); PENDING ones do not.
- When sinfo's used count for a node exceeds what squeue's indexes explain (the two are read at
  different moments; a job's detail may be missing), the unexplained GPUs are treated as busy:
  Slurm does not say which, so they are taken from the **highest** free indexes and marked
  ``unattributed``. More indexes than the count (squeue newer than sinfo) are all kept busy.
- Open reservations (the ledger) are counts per node, not indexes: they lower the node's ``free``.
- A probe report (:class:`ProbeReport`) older than ``probe_ttl_s`` is stale: it stops influencing
  decisions (its GPU fields are dropped, the node is scored on Slurm data alone) and the node view
  says so (``probe_stale``, ``probe_age_s``). A fresh probe can mark GPUs unhealthy (lost, ECC) or
  foreign (GPU memory held by a process that belongs to no Slurm job); neither counts as free.
  Probe GPUs are matched to Slurm's GRES indexes by index; GPUs a probe does not list keep no
  probe data (the probe itself reports a lost GPU as an unhealthy row).

How it is built (``bench/placement.py``: ingest at 10k nodes x 8 GPUs): a
:class:`SnapshotBuilder` (one per broker, as the Slurm readers are one per client) computes only
what the placement arrays hold (free, usable, tainted, load, partition and GPU type groups), and
between builds keeps them per node with what they came from (:mod:`xhpc.placement.rows`): a
steady poll, whose readers hand back the same objects for what did not change, computes again
only the nodes whose node, jobs or probe report changed. :func:`build_snapshot` is a build by a
new builder. The :class:`ClusterSnapshot` keeps those arrays and its inputs (:class:`Sources`),
and builds the per-node and per-GPU views when they are first read: all at once for
``snapshot.nodes`` (a cached property), one node for ``snapshot.node(name)``. A placement
decision reads only the arrays. Both follow the rules above; the tests check that they agree.

Nothing here mutates its inputs; every model is frozen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property

from xhpc.models import HOLDING_STATES, ProbeReport, Reservation
from xhpc.placement.arrays import IntArray, SnapshotArrays, frozen
from xhpc.placement.rows import NodeRows
from xhpc.placement.sources import SlurmJobLike, SlurmNodeLike, Sources, age_s
from xhpc.placement.views import GpuView, NodeView, SnapshotView, node_load

__all__ = [
    "HOLDING_STATES",
    "ClusterSnapshot",
    "GpuView",
    "NodeView",
    "SnapshotBuilder",
    "SnapshotView",
    "apply_reservations",
    "arrays_for",
    "build_snapshot",
    "node_load",
]


class ClusterSnapshot:
    """One snapshot: the placement arrays, built once, and the node views, built when read.

    Made by :class:`SnapshotBuilder` / :func:`build_snapshot` (and :func:`apply_reservations`);
    immutable. ``nodes`` (every
    node's view, sorted by name) is built on first read and kept; :meth:`node` builds one view;
    :meth:`view` is the whole snapshot as one pydantic model (what ``GET /v1/nodes`` sends).
    """

    def __init__(
        self,
        *,
        taken_at: datetime,
        probe_ttl_s: float,
        sinfo_age_s: float | None,
        squeue_age_s: float | None,
        arrays: SnapshotArrays,
        sources: Sources,
        unreserved: IntArray,
    ) -> None:
        self.taken_at = taken_at
        self.probe_ttl_s = probe_ttl_s
        self.sinfo_age_s = sinfo_age_s
        self.squeue_age_s = squeue_age_s
        self.arrays = arrays
        self._sources = sources
        self._unreserved = unreserved  # per node: NodeView.idle (free before reservations)

    @cached_property
    def nodes(self) -> tuple[NodeView, ...]:
        """Every node's view, sorted by name (built on first read)."""
        return self._sources.all()

    def node(self, name: str) -> NodeView | None:
        """The view of the node called ``name`` (only that one built), or None."""
        return self._sources.node(name)

    def view(self) -> SnapshotView:
        return SnapshotView(
            taken_at=self.taken_at,
            nodes=self.nodes,
            probe_ttl_s=self.probe_ttl_s,
            sinfo_age_s=self.sinfo_age_s,
            squeue_age_s=self.squeue_age_s,
        )

    def __repr__(self) -> str:
        n = len(self.arrays.names)
        return f"<ClusterSnapshot taken_at={self.taken_at.isoformat()} nodes={n}>"


def arrays_for(snapshot: ClusterSnapshot) -> SnapshotArrays:
    """``snapshot.arrays``: the columns a decision reads."""
    return snapshot.arrays


class SnapshotBuilder:
    """Builds successive snapshots, computing again only what changed since its last build.

    Hold one and pass it each poll's nodes and jobs (as the Slurm readers give them: the same
    objects for what did not change) and the current probe reports; every build's result is
    what :func:`build_snapshot` gives for the same inputs. The inputs must be immutable (the
    models are frozen). A build that raises leaves the builder as a new one.
    """

    def __init__(self) -> None:
        self._rows = NodeRows()

    def build(
        self,
        nodes: Iterable[SlurmNodeLike],
        jobs: Iterable[SlurmJobLike],
        reservations: Sequence[Reservation] = (),
        probes: Mapping[str, ProbeReport] | None = None,
        *,
        now: datetime,
        probe_ttl_s: float = 30.0,
        sinfo_at: datetime | None = None,
        squeue_at: datetime | None = None,
    ) -> ClusterSnapshot:
        """Merge sinfo, squeue, the open reservations and the probe reports (keyed by node name).

        ``now`` must be timezone-aware (as every timestamp in xhpc). Jobs, reservations and
        probes for nodes sinfo does not list are ignored.

        ``nodes`` and ``jobs``: :class:`~xhpc.models.NodeInfo` / :class:`~xhpc.models.JobInfo`
        (the broker's view). Computes the placement arrays of the result: a decision on it
        builds nothing more. The node views are built when first read (see the module
        docstring).
        """
        if now.tzinfo is None:
            raise ValueError("build_snapshot: `now` must be timezone-aware")
        probe_ttl_s = float(probe_ttl_s)
        node_list = nodes if isinstance(nodes, list | tuple) else list(nodes)
        job_list, reports = tuple(jobs), dict(probes or {})
        reserved: dict[str, int] = {}
        for r in reservations:
            for node in r.nodes:
                reserved[node] = reserved.get(node, 0) + max(0, r.gpus)
        rows = self._rows
        try:
            rows.update(node_list, job_list, reports)
            arrays, unreserved = rows.arrays(reserved, now, probe_ttl_s)
        except BaseException:
            self._rows = NodeRows()
            raise
        source = Sources(
            rows.nodes,
            rows.names,
            rows.index,
            job_list,
            reserved,
            reports,
            now,
            probe_ttl_s,
        )
        return ClusterSnapshot(
            taken_at=now,
            probe_ttl_s=probe_ttl_s,
            sinfo_age_s=age_s(now, sinfo_at),
            squeue_age_s=age_s(now, squeue_at),
            arrays=arrays,
            sources=source,
            unreserved=unreserved,
        )


def build_snapshot(
    nodes: Iterable[SlurmNodeLike],
    jobs: Iterable[SlurmJobLike],
    reservations: Sequence[Reservation] = (),
    probes: Mapping[str, ProbeReport] | None = None,
    *,
    now: datetime,
    probe_ttl_s: float = 30.0,
    sinfo_at: datetime | None = None,
    squeue_at: datetime | None = None,
) -> ClusterSnapshot:
    """One snapshot from these inputs, computed whole (:meth:`SnapshotBuilder.build` of a new
    builder: see there)."""
    return SnapshotBuilder().build(
        nodes,
        jobs,
        reservations,
        probes,
        now=now,
        probe_ttl_s=probe_ttl_s,
        sinfo_at=sinfo_at,
        squeue_at=squeue_at,
    )


def apply_reservations(
    snapshot: ClusterSnapshot, reservations: Sequence[Reservation]
) -> ClusterSnapshot:
    """A new snapshot with these reservations added, without rebuilding the rest.

    For the ledger's "concurrent launches see each other": after writing a reservation the
    broker places the next request on ``apply_reservations(snapshot, [new])`` instead of a fresh
    ``build_snapshot``. The new snapshot's arrays are the old ones with the named nodes' free
    counts recomputed (from the free counts before reservations, no view built); its views are
    the parent's but for the reserved nodes', once built.
    Reservations on unknown nodes are ignored. The parent is unchanged.
    """
    parent = snapshot.arrays
    extra: dict[int, int] = {}
    for r in reservations:
        for node in r.nodes:
            i = parent.index.get(node)
            if i is not None and r.gpus > 0:
                extra[i] = extra.get(i, 0) + r.gpus
    names = parent.names
    sources = snapshot._sources.with_reserved({names[i]: count for i, count in extra.items()})
    free = parent.free.copy()
    unreserved = snapshot._unreserved
    for i in extra:
        free[i] = max(0, int(unreserved[i]) - sources.reserved[names[i]])  # NodeView.free
    frozen(free)
    return ClusterSnapshot(
        taken_at=snapshot.taken_at,
        probe_ttl_s=snapshot.probe_ttl_s,
        sinfo_age_s=snapshot.sinfo_age_s,
        squeue_age_s=snapshot.squeue_age_s,
        arrays=dataclasses.replace(parent, free=free),
        sources=sources,
        unreserved=unreserved,
    )
