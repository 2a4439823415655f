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

How it is built (``bench/placement.py``: ingest at 10k nodes x 8 GPUs): one pass over the nodes
computes only what the placement arrays hold (free, usable, tainted, load, partition and GPU type
groups); the :class:`ClusterSnapshot` keeps those arrays and its inputs (:class:`Sources`), and
builds the per-node and per-GPU views when they are first read: all at once for
``snapshot.nodes`` (a cached property), one node for ``snapshot.node(name)``. A placement
decision reads only the arrays. Both follow the rules above; the tests check that they agree.

Nothing here mutates its inputs; every model is frozen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cached_property

from xhpc.models import GpuProbe, ProbeReport, Reservation
from xhpc.placement.arrays import Columns, SnapshotArrays, frozen
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.sources import (
    NO_JOBS,
    Held,
    SlurmJobLike,
    SlurmNodeLike,
    Sources,
    age_s,
    is_foreign,
    unattributed_of,
)
from xhpc.placement.views import (
    HOLDING_STATES,
    GpuView,
    NodeView,
    SnapshotView,
    _fractions,
    _mean_load,
    node_load,
)
from xhpc.slurm.parse import parse_gres

__all__ = [
    "HOLDING_STATES",
    "ClusterSnapshot",
    "GpuView",
    "NodeView",
    "SnapshotView",
    "apply_reservations",
    "arrays_for",
    "build_snapshot",
    "node_load",
]


class ClusterSnapshot:
    """One snapshot: the placement arrays, built once, and the node views, built when read.

    Made by :func:`build_snapshot` (and :func:`apply_reservations`); immutable. ``nodes`` (every
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
    ) -> None:
        self.taken_at = taken_at
        self.probe_ttl_s = probe_ttl_s
        self.sinfo_age_s = sinfo_age_s
        self.squeue_age_s = squeue_age_s
        self.arrays = arrays
        self._sources = sources

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


def _job_gpus(jobs: Iterable[SlurmJobLike]) -> dict[str, dict[int, tuple[str, ...]]]:
    """node -> GPU index -> ids of the resource-holding jobs whose gres_detail names it."""
    held: dict[str, dict[int, tuple[str, ...]]] = {}
    # gres_detail -> (IDX, no index twice): few distinct strings
    indexes_of: dict[str, tuple[tuple[int, ...], bool]] = {}
    holding = HOLDING_STATES
    for job in jobs:
        details = job.gres_detail
        if not details:
            continue
        state = job.state
        if state not in holding and state.upper() not in holding:
            continue
        text = job.nodes
        ids = (job.job_id,)  # one tuple for all the job's GPUs (the views' slurm_jobs)
        if (
            len(details) == 1
            and text
            and text.isalnum()
            and (len(text) != 4 or text.lower() != "none")
        ):  # the usual job: one plain node name (expand_hostlist gives it back), one detail
            detail = details[0]
            parsed = indexes_of.get(detail)
            if parsed is None:
                indexes = parse_gres(detail)[2]
                parsed = indexes_of[detail] = (indexes, len(set(indexes)) == len(indexes))
            indexes, distinct = parsed
            per_gpu = held.get(text)
            if per_gpu is None and distinct:
                held[text] = dict.fromkeys(indexes, ids)
                continue
            pairs: Iterable[tuple[str, tuple[int, ...]]] = ((text, indexes),)
        else:
            hosts = expand_hostlist(text) or ((job.batch_host,) if job.batch_host else ())
            if len(hosts) == len(details):
                pairs = [(h, parse_gres(d)[2]) for h, d in zip(hosts, details, strict=True)]
            elif len(hosts) == 1:
                pairs = ((hosts[0], job.gpus_idx),)
            else:  # cannot align details with nodes: sinfo's used counts cover these GPUs
                continue
        for host, indexes in pairs:
            per_gpu = held.get(host)
            if per_gpu is None:
                per_gpu = held[host] = {}
            for index in indexes:
                before = per_gpu.get(index)
                per_gpu[index] = ids if before is None else before + ids
    return held


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
    """Merge sinfo, squeue, the open reservations and the probe reports (keyed by node name).

    ``now`` must be timezone-aware (as every timestamp in xhpc). Jobs, reservations and probes for
    nodes sinfo does not list are ignored.

    ``nodes`` and ``jobs``: :class:`~xhpc.models.NodeInfo` / :class:`~xhpc.models.JobInfo` (the
    broker's view). One pass computes the placement arrays of the result: a decision on it
    builds nothing more. The node views are built when first read (see
    the module docstring).
    """
    if now.tzinfo is None:
        raise ValueError("build_snapshot: `now` must be timezone-aware")
    probe_ttl_s = float(probe_ttl_s)
    held = _job_gpus(jobs)
    reserved: dict[str, int] = {}
    for r in reservations:
        reserved[r.node] = reserved.get(r.node, 0) + max(0, r.gpus)
    by_name: dict[str, SlurmNodeLike] = {n.name: n for n in nodes}
    names = sorted(by_name)
    source = Sources(by_name, names, held, reserved, dict(probes or {}), now, probe_ttl_s)
    columns = _columns(source)
    return ClusterSnapshot(
        taken_at=now,
        probe_ttl_s=probe_ttl_s,
        sinfo_age_s=age_s(now, sinfo_at),
        squeue_age_s=age_s(now, squeue_at),
        arrays=SnapshotArrays.from_columns(columns, names_sorted=True, index=source.index),
        sources=source,
    )


def _columns(source: Sources) -> Columns:
    """What the arrays need, node by node: the :class:`NodeView` properties, without views.

    The same rules as :meth:`Sources._build_view`, counted instead of built: a GPU is idle when
    it is neither held (by a job's IDX, in range), unattributed (never one of those), nor unclean
    by a fresh probe; tainted and load come from the fresh probe alone (:func:`_probe_part`).
    """
    by_name, held, probes, reserved = source.by_name, source.held, source.probes, source.reserved
    ttl_s = source.probe_ttl_s
    now_us = (source.now - _EPOCH) // _US
    columns = Columns()
    names_out, free_out, usable_out = columns.names, columns.free, columns.usable
    tainted_out, load_out = columns.tainted, columns.load
    by_partitions, by_gpu_type = columns.by_partitions, columns.by_gpu_type
    usable_of: dict[tuple[str, tuple[str, ...]], bool] = {}  # few distinct states in a cluster
    ranges: dict[int, frozenset[int]] = {}  # gpus_total -> its indexes
    fractions: dict[Readings, Fractions] = {}  # few distinct readings
    max_gpus = 0
    for i, name in enumerate(source.names):
        node = by_name[name]
        total = node.gpus_total
        held_here: Held = held.get(name) or NO_JOBS
        n_held = 0
        if held_here:
            keys = held_here.keys()
            indexes = ranges.get(total)
            if indexes is None:
                indexes = ranges[total] = frozenset(range(total))
            n_held = len(keys) if keys <= indexes else len(keys & indexes)
        unattributed: Collection[int] = ()
        if node.gpus_used_idx or node.gpus_used > n_held:
            unattributed = unattributed_of(node, held_here)
        idle = total - n_held - len(unattributed)
        tainted = False
        load = 0.0
        probe = probes.get(name)
        if probe is not None:
            taken_us, lists_gpus, unclean, probe_load = _probe_part(probe, total, fractions)
            age = (now_us - taken_us) / 1_000_000  # == (now - taken_at).total_seconds()
            if lists_gpus and not max(0.0, age) > ttl_s:  # fresh, and it lists GPUs
                load = probe_load
                if unclean:
                    tainted = True
                    for index in unclean:
                        if index not in held_here and index not in unattributed:
                            idle -= 1
        free = idle - reserved.get(name, 0)
        names_out.append(name)
        free_out.append(free if free > 0 else 0)
        key = (node.state, node.state_flags)
        usable = usable_of.get(key)
        if usable is None:
            usable = usable_of[key] = node.usable
        usable_out.append(usable)
        tainted_out.append(tainted)
        load_out.append(load)
        group = by_partitions.get(node.partitions)
        if group is None:
            group = by_partitions[node.partitions] = []
        group.append(i)
        group = by_gpu_type.get(node.gpu_type)
        if group is None:
            group = by_gpu_type[node.gpu_type] = []
        group.append(i)
        if total > max_gpus:
            max_gpus = total
    columns.max_gpus = max_gpus
    return columns


Readings = tuple[float | None, float | None, float | None]  # util_pct, mem_used_mb, mem_total_mb
Fractions = tuple[float | None, float | None]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def _probe_part(
    probe: ProbeReport, total: int, fractions: dict[Readings, Fractions]
) -> tuple[int, bool, tuple[int, ...], float]:
    """What a probe report adds to its node's columns: (taken_at in microseconds since the epoch,
    lists GPUs, unclean indexes, load) over the node's ``total`` GPUs (the last row of an index
    wins, as in the views)."""
    taken_us = (probe.taken_at - _EPOCH) // _US  # (a naive time raises here, as age_s does)
    gpus: Sequence[GpuProbe] = probe.gpus
    for i, gpu in enumerate(gpus):
        if gpu.index != i:  # not the usual rows 0, 1, 2, ...: by index, the last row wins
            seen = {g.index: g for g in gpus}
            gpus = [seen[i] for i in range(total) if i in seen]
            break
    else:
        if len(gpus) > total:
            gpus = gpus[:total]
    unclean: list[int] = []
    utils: list[float] = []
    mems: list[float] = []
    for gpu in gpus:  # in index order, as the views' load reads them
        readings = (gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb)
        util, mem = fractions.get(readings) or fractions.setdefault(readings, _fractions(*readings))
        if util is not None:
            utils.append(util)
        if mem is not None:
            mems.append(mem)
        if not gpu.healthy or (gpu.processes and is_foreign(gpu)):
            unclean.append(gpu.index)
    return taken_us, bool(probe.gpus), tuple(unclean), _mean_load(utils, mems)


def apply_reservations(
    snapshot: ClusterSnapshot, reservations: Sequence[Reservation]
) -> ClusterSnapshot:
    """A new snapshot with these reservations added, without rebuilding the rest.

    For the ledger's "concurrent launches see each other": after writing a reservation the
    broker places the next request on ``apply_reservations(snapshot, [new])`` instead of a fresh
    ``build_snapshot``. The new snapshot's arrays are the old ones with the named nodes' free
    counts recomputed (from those nodes' views); its other views are the parent's, once built.
    Reservations on unknown nodes are ignored. The parent is unchanged.
    """
    parent = snapshot.arrays
    extra: dict[int, int] = {}
    for r in reservations:
        i = parent.index.get(r.node)
        if i is not None and r.gpus > 0:
            extra[i] = extra.get(i, 0) + r.gpus
    names = parent.names
    sources = snapshot._sources.with_reserved({names[i]: count for i, count in extra.items()})
    free = parent.free.copy()
    for i in extra:
        free[i] = sources.view(i).free
    frozen(free)
    return ClusterSnapshot(
        taken_at=snapshot.taken_at,
        probe_ttl_s=snapshot.probe_ttl_s,
        sinfo_age_s=snapshot.sinfo_age_s,
        squeue_age_s=snapshot.squeue_age_s,
        arrays=dataclasses.replace(parent, free=free),
        sources=sources,
    )
