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
groups) and leaves the arrays in :func:`~xhpc.placement.arrays.arrays_for`'s cache; the per-node
and per-GPU views are built from the same inputs (:class:`Sources`) when something first reads
them (see :mod:`xhpc.placement.views`): all at once for ``snapshot.nodes``, one node for
``snapshot.node(name)``. Both follow the rules above; the tests check that they agree.

Nothing here mutates its inputs; every model is frozen.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

from xhpc.models import GpuProbe, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.sources import (
    NO_JOBS,
    RANGES,
    Held,
    Sources,
    age_s,
    gpu_indexes,
    is_foreign,
    unattributed_of,
)
from xhpc.placement.views import (
    HOLDING_STATES,
    ClusterSnapshot,
    GpuView,
    NodeView,
    _fractions,
    _mean_load,
    defer_nodes,
    deferred_source,
    node_load,
)
from xhpc.slurm.parse import gc_paused, parse_gres, trusted_model

__all__ = [
    "HOLDING_STATES",
    "ClusterSnapshot",
    "GpuView",
    "NodeView",
    "build_snapshot",
    "node_load",
]

_snapshot_of = trusted_model(ClusterSnapshot)


def _job_gpus(jobs: Sequence[JobInfo]) -> dict[str, dict[int, tuple[str, ...]]]:
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
        "usable",
    )

    def __init__(self) -> None:
        self.names: list[str] = []
        self.free: list[int] = []
        self.usable: list[bool] = []
        self.tainted: list[bool] = []
        self.load: list[float] = []
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


def build_snapshot(
    nodes: Sequence[NodeInfo],
    jobs: Sequence[JobInfo],
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

    One pass with the garbage collector paused (``bench/placement.py``: ingest at 10k nodes),
    which fills in the placement arrays of the result (see
    :func:`~xhpc.placement.arrays.arrays_for`): a decision on it builds nothing more. The node
    views are built when first read (see the module docstring).
    """
    if now.tzinfo is None:
        raise ValueError("build_snapshot: `now` must be timezone-aware")
    with gc_paused():
        return _build(
            nodes, jobs, reservations, probes or {}, now, probe_ttl_s, sinfo_at, squeue_at
        )


def _build(
    nodes: Sequence[NodeInfo],
    jobs: Sequence[JobInfo],
    reservations: Sequence[Reservation],
    probes: Mapping[str, ProbeReport],
    now: datetime,
    probe_ttl_s: float,
    sinfo_at: datetime | None,
    squeue_at: datetime | None,
) -> ClusterSnapshot:
    from xhpc.placement.arrays import SnapshotArrays, remember  # here: arrays imports this module

    held = _job_gpus(jobs)
    reserved: dict[str, int] = {}
    for r in reservations:
        reserved[r.node] = reserved.get(r.node, 0) + max(0, r.gpus)
    by_name = {n.name: n for n in nodes}
    names = sorted(by_name)
    source = Sources(by_name, names, held, reserved, dict(probes), now, probe_ttl_s)
    columns = _columns(source)

    fields = {
        "taken_at": now,
        "probe_ttl_s": probe_ttl_s,
        "sinfo_age_s": age_s(now, sinfo_at),
        "squeue_age_s": age_s(now, squeue_at),
    }
    if type(now) is datetime and type(probe_ttl_s) is float:  # names are unique: by_name
        snapshot = _snapshot_of(fields)
    else:  # let validation convert them, as it always did (then defer the views)
        snapshot = ClusterSnapshot.model_validate({**fields, "nodes": ()})
        object.__setattr__(
            snapshot, "__dict__", {k: v for k, v in snapshot.__dict__.items() if k != "nodes"}
        )
    defer_nodes(snapshot, source)
    arrays = SnapshotArrays.from_columns(columns, names_sorted=True, index=source.index)
    remember(snapshot, arrays)
    return snapshot


def _columns(source: Sources) -> Columns:
    """What the arrays need, node by node: the :class:`NodeView` properties, without views.

    The same rules as :meth:`Sources._build_view`, counted instead of built: a GPU is idle when
    it is neither held (by a job's IDX, in range), unattributed (never one of those), nor unclean
    by a fresh probe; tainted and load come from the fresh probe alone (:func:`_probe_part`).
    """
    global _probe_parts
    by_name, held, probes, reserved = source.by_name, source.held, source.probes, source.reserved
    ttl_s = source.probe_ttl_s
    now_us = (source.now - _EPOCH) // _US
    parts_before, parts = _probe_parts, {}
    columns = Columns()
    names_out, free_out, usable_out = columns.names, columns.free, columns.usable
    tainted_out, load_out = columns.tainted, columns.load
    by_partitions, by_gpu_type = columns.by_partitions, columns.by_gpu_type
    usable_of = source.usable
    ranges = RANGES
    max_gpus = 0
    for i, name in enumerate(source.names):
        node = by_name[name]
        total = node.gpus_total
        held_here: Held = held.get(name) or NO_JOBS
        n_held = 0
        if held_here:
            keys = held_here.keys()
            indexes = ranges.get(total) or gpu_indexes(total)
            n_held = len(keys) if keys <= indexes else len(keys & indexes)
        unattributed: Collection[int] = ()
        if node.gpus_used_idx or node.gpus_used > n_held:
            unattributed = unattributed_of(node, held_here)
        idle = total - n_held - len(unattributed)
        tainted = False
        load = 0.0
        probe = probes.get(name)
        if probe is not None:
            part = parts_before.get(id(probe))
            if part is None or part[0] is not probe or part[1] != total:
                part = _probe_part(probe, total, source)
            parts[id(probe)] = part
            age = (now_us - part[2]) / 1_000_000  # == (now - taken_at).total_seconds()
            if part[3] and not max(0.0, age) > ttl_s:  # fresh, and it lists GPUs
                unclean, load = part[4], part[5]
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
    _probe_parts = parts  # what the next build may reuse: this build's reports
    return columns


# A probe report's part in its node's columns: (report, gpus_total, taken_at in microseconds since
# the epoch, lists GPUs, unclean indexes, load). The same report objects come back build after
# build (the broker keeps each node's latest report until the next one, seconds later), so the
# parts of the last build's reports are kept, by report identity (the report is held, so its id
# is not reused).
ProbePart = tuple[ProbeReport, int, int, bool, tuple[int, ...], float]
_probe_parts: dict[int, ProbePart] = {}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def _probe_part(probe: ProbeReport, total: int, source: Sources) -> ProbePart:
    """The probe's GPUs among the node's ``total`` (the last row of an index wins), read once."""
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
    fractions = source.fractions
    for gpu in gpus:  # in index order, as the views' load reads them
        readings = (gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb)
        util, mem = fractions.get(readings) or fractions.setdefault(readings, _fractions(*readings))
        if util is not None:
            utils.append(util)
        if mem is not None:
            mems.append(mem)
        if not gpu.healthy or (gpu.processes and is_foreign(gpu)):
            unclean.append(gpu.index)
    return probe, total, taken_us, bool(probe.gpus), tuple(unclean), _mean_load(utils, mems)


def add_reserved(
    snapshot: ClusterSnapshot, extra: Mapping[int, int]
) -> tuple[ClusterSnapshot, dict[int, int]]:
    """A copy of ``snapshot`` with ``extra[i]`` more GPUs reserved on its node ``i``, and the new
    ``free`` of those nodes (for :func:`~xhpc.placement.arrays.apply_reservations`).

    Deferred views stay deferred: only the changed nodes' views are built, to read ``free``.
    """
    source = deferred_source(snapshot)
    if isinstance(source, Sources):
        names = source.names
        child_source = source.with_reserved({names[i]: count for i, count in extra.items()})
        child = _snapshot_of({k: v for k, v in snapshot.__dict__.items() if k != "nodes"})
        defer_nodes(child, child_source)
        return child, {i: child_source.view(i).free for i in extra}
    nodes = list(snapshot.nodes)
    for i, count in extra.items():
        nodes[i] = nodes[i].model_copy(update={"reserved": nodes[i].reserved + count})
    child = snapshot.model_copy(update={"nodes": tuple(nodes)})
    return child, {i: nodes[i].free for i in extra}
