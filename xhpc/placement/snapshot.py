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

Nothing here mutates its inputs; every model is frozen.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime

from xhpc.models import GpuProbe, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.views import (
    HOLDING_STATES,
    ClusterSnapshot,
    GpuView,
    NodeView,
    _fractions,
    _mean_load,
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


def _age_s(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _job_gpus(jobs: Sequence[JobInfo]) -> dict[str, dict[int, tuple[str, ...]]]:
    """node -> GPU index -> ids of the resource-holding jobs whose gres_detail names it."""
    held: dict[str, dict[int, tuple[str, ...]]] = {}
    indexes_of: dict[str, tuple[int, ...]] = {}  # gres_detail -> IDX: few distinct strings
    for job in jobs:
        details = job.gres_detail
        state = job.state
        if not details or (state not in HOLDING_STATES and state.upper() not in HOLDING_STATES):
            continue
        text = job.nodes
        pairs: Iterable[tuple[str, tuple[int, ...]]]
        if len(details) == 1 and text and text.isalnum() and text.lower() != "none":
            # the usual job: one plain node name (expand_hostlist gives it back), one detail
            detail = details[0]
            indexes = indexes_of.get(detail)
            if indexes is None:
                indexes = indexes_of[detail] = parse_gres(detail)[2]
            pairs = ((text, indexes),)
        else:
            hosts = expand_hostlist(text) or ((job.batch_host,) if job.batch_host else ())
            if len(hosts) == len(details):
                pairs = [(h, parse_gres(d)[2]) for h, d in zip(hosts, details, strict=True)]
            elif len(hosts) == 1:
                pairs = ((hosts[0], job.gpus_idx),)
            else:  # cannot align details with nodes: sinfo's used counts cover these GPUs
                continue
        ids = (job.job_id,)  # one tuple for all the job's GPUs (the views' slurm_jobs)
        for host, indexes in pairs:
            per_gpu = held.get(host)
            if per_gpu is None:
                per_gpu = held[host] = {}
            for index in indexes:
                before = per_gpu.get(index)
                per_gpu[index] = ids if before is None else before + ids
    return held


def _unattributed(node: NodeInfo, held: Mapping[int, tuple[str, ...]]) -> set[int] | tuple[()]:
    """GPUs Slurm counts as used that no job's IDX names (see the module docstring)."""
    total, used_idx = node.gpus_total, node.gpus_used_idx
    busy: Collection[int]
    unattributed: set[int]
    if used_idx:
        busy = {i for i in held if 0 <= i < total} | {i for i in used_idx if 0 <= i < total}
        unattributed = {i for i in used_idx if 0 <= i < total and i not in held}
    elif not held or (min(held) >= 0 and max(held) < total):
        busy, unattributed = held, set()  # (the usual case: no set to build)
    else:
        busy, unattributed = {i for i in held if 0 <= i < total}, set()
    missing = max(0, node.gpus_used - len(busy))
    for index in range(total - 1, -1, -1):  # unexplained use: highest free indexes first
        if missing == 0:
            break
        if index not in busy:
            unattributed.add(index)
            missing -= 1
    return unattributed or ()


def _is_foreign(gpu: GpuProbe) -> bool:
    return any(
        p.job_id is None and (p.mem_used_mb is None or p.mem_used_mb > 0) for p in gpu.processes
    )


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


# -- building the views without validating them again ------------------------------------------
# Every value below comes from validated models (NodeInfo, JobInfo, ProbeReport, Reservation) or
# is computed here with the field's type, so the views are built with `trusted_model`: equal,
# field for field and in `model_fields_set`, to what `GpuView(...)` / `NodeView(...)` would build
# (tests/unit/test_placement_ingest.py checks it against the validating build). Views are
# immutable, so equal ones are one object: a GPU no job holds and no fresh probe describes is
# shared by every node and snapshot, and a probed GPU no job holds by the nodes of one build.

_SLURM_ONLY = {"index", "slurm_jobs", "unattributed"}  # what GpuView(...) is given without probe
_gpu_slurm = trusted_model(GpuView, _SLURM_ONLY)
_gpu_probed = trusted_model(GpuView)
_node_view = trusted_model(NodeView)
_snapshot_of = trusted_model(ClusterSnapshot)
_SHARED_MAX = 256  # GPU indexes (and GPUs per node) with a shared view
_shared: dict[tuple[int, bool], GpuView] = {}
_idle_rows: dict[int, tuple[GpuView, ...]] = {}


def _unheld(index: int, unattributed: bool) -> GpuView:
    """``GpuView(index=index, slurm_jobs=(), unattributed=unattributed)``, shared."""
    key = (index, unattributed)
    view = _shared.get(key)
    if view is None:
        view = GpuView(index=index, slurm_jobs=(), unattributed=unattributed)
        if index < _SHARED_MAX:
            _shared[key] = view
    return view


def _idle_row(total: int) -> tuple[GpuView, ...]:
    """The GPUs of a node no job holds and no fresh probe describes, shared."""
    row = _idle_rows.get(total)
    if row is None:
        row = tuple(_unheld(index, False) for index in range(total))
        if total < _SHARED_MAX:
            _idle_rows[total] = row
    return row


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
    which also fills in the placement arrays of the result (see
    :func:`~xhpc.placement.arrays.arrays_for`): a decision on it builds nothing more.
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

    usable_of: dict[tuple[str, tuple[str, ...]], bool] = {}
    # probed GPUs no job holds, by value: (view, utilisation and memory fractions)
    probed: dict[tuple[object, ...], tuple[GpuView, float | None, float | None]] = {}
    fractions: dict[tuple[float | None, ...], tuple[float | None, float | None]] = {}
    no_jobs: dict[int, tuple[str, ...]] = {}
    views: list[NodeView] = []
    columns = Columns()
    for name in names:
        node = by_name[name]
        total = node.gpus_total
        held_here = held.get(name, no_jobs)
        unattributed = (
            _unattributed(node, held_here) if node.gpus_used or node.gpus_used_idx else ()
        )
        probe = probes.get(name)
        probe_age = _age_s(now, probe.taken_at) if probe is not None else None
        stale = probe_age is not None and probe_age > probe_ttl_s
        seen = {g.index: g for g in probe.gpus} if probe is not None and not stale else None

        tainted = False
        load = 0.0
        gpus = _idle_row(total)
        idle = total
        if not seen:  # Slurm's view only: the shared idle row, with the held GPUs replaced
            if held_here or unattributed:
                row = list(gpus)
                for index, ids in held_here.items():
                    if 0 <= index < total:
                        row[index] = _gpu_slurm(
                            {
                                "index": index,
                                "slurm_jobs": ids,
                                "unattributed": index in unattributed,
                                "healthy": True,
                                "foreign": False,
                                "util_pct": None,
                                "mem_used_mb": None,
                                "mem_total_mb": None,
                                "error": None,
                            }
                        )
                        idle -= 1
                for index in unattributed:
                    if index not in held_here:
                        row[index] = _unheld(index, True)
                        idle -= 1
                gpus = tuple(row)
        else:
            row = []
            utils: list[float] = []
            mems: list[float] = []
            idle = 0
            for index in range(total):
                ids = held_here.get(index, ())
                unatt = index in unattributed
                gpu = seen.get(index)
                if gpu is None:
                    if ids:
                        row.append(
                            _gpu_slurm(
                                {
                                    "index": index,
                                    "slurm_jobs": ids,
                                    "unattributed": unatt,
                                    "healthy": True,
                                    "foreign": False,
                                    "util_pct": None,
                                    "mem_used_mb": None,
                                    "mem_total_mb": None,
                                    "error": None,
                                }
                            )
                        )
                    else:
                        row.append(_unheld(index, unatt))
                        if not unatt:
                            idle += 1
                    continue
                healthy = gpu.healthy
                foreign = bool(gpu.processes) and _is_foreign(gpu)
                error = gpu.error
                util_pct, mem_used, mem_total = gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb
                if ids:  # its own view
                    readings = (util_pct, mem_used, mem_total)
                    util, mem = fractions.get(readings) or fractions.setdefault(
                        readings, _fractions(util_pct, mem_used, mem_total)
                    )
                    view = _gpu_probed(
                        {
                            "index": index,
                            "slurm_jobs": ids,
                            "unattributed": unatt,
                            "healthy": healthy,
                            "foreign": foreign,
                            "util_pct": util_pct,
                            "mem_used_mb": mem_used,
                            "mem_total_mb": mem_total,
                            "error": error,
                        }
                    )
                else:  # the view of every equal GPU of this build (zeros by repr: 0.0 vs -0.0)
                    key = (
                        index,
                        unatt,
                        healthy,
                        foreign,
                        error,
                        util_pct or repr(util_pct),
                        mem_used or repr(mem_used),
                        mem_total or repr(mem_total),
                    )
                    hit = probed.get(key)
                    if hit is None:
                        hit = probed[key] = (
                            _gpu_probed(
                                {
                                    "index": index,
                                    "slurm_jobs": (),
                                    "unattributed": unatt,
                                    "healthy": healthy,
                                    "foreign": foreign,
                                    "util_pct": util_pct,
                                    "mem_used_mb": mem_used,
                                    "mem_total_mb": mem_total,
                                    "error": error,
                                }
                            ),
                            *_fractions(util_pct, mem_used, mem_total),
                        )
                    view, util, mem = hit
                if util is not None:
                    utils.append(util)
                if mem is not None:
                    mems.append(mem)
                row.append(view)
                if not healthy or foreign:
                    tainted = True
                elif not ids and not unatt:
                    idle += 1
            gpus = tuple(row)
            load = _mean_load(utils, mems)

        state_key = (node.state, node.state_flags)
        usable = usable_of.get(state_key)
        if usable is None:
            usable = usable_of[state_key] = node.usable
        reserved_here = reserved.get(name, 0)
        views.append(
            _node_view(
                {
                    "name": name,
                    "address": node.address,
                    "state": node.state,
                    "state_flags": node.state_flags,
                    "reason": node.reason,
                    "usable": usable,
                    "partitions": node.partitions,
                    "gpu_type": node.gpu_type,
                    "gpus": gpus,
                    "reserved": reserved_here,
                    "probe_age_s": probe_age,
                    "probe_stale": stale,
                }
            )
        )
        columns.add(
            name,
            free=max(0, idle - reserved_here),
            usable=usable,
            tainted=tainted,
            load=load,
            partitions=node.partitions,
            gpu_type=node.gpu_type,
            gpus=total,
        )

    fields = {
        "taken_at": now,
        "nodes": tuple(views),
        "probe_ttl_s": probe_ttl_s,
        "sinfo_age_s": _age_s(now, sinfo_at),
        "squeue_age_s": _age_s(now, squeue_at),
    }
    if type(now) is datetime and type(probe_ttl_s) is float:  # names are unique: by_name
        snapshot = _snapshot_of(fields)
    else:  # let validation convert them, as it always did
        snapshot = ClusterSnapshot.model_validate(fields)
    arrays = SnapshotArrays.from_columns(columns, names_sorted=True)
    remember(snapshot, arrays)
    return snapshot
