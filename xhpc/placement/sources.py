"""The inputs of one snapshot build, and the node views built from them when first read (pure).

:func:`~xhpc.placement.snapshot.build_snapshot` keeps its inputs in a :class:`Sources` and
computes only the placement arrays; a :class:`Sources` builds a node's :class:`NodeView` (and its
:class:`GpuView` row) when the snapshot's views are first read (see
:mod:`xhpc.placement.views`). The rules are the snapshot module's; the helpers both use are here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime

from xhpc.models import GpuProbe, NodeInfo, ProbeReport
from xhpc.placement.views import GpuView, NodeView
from xhpc.slurm.parse import gc_paused, trusted_model

Held = Mapping[int, tuple[str, ...]]  # GPU index -> ids of the jobs holding it
NO_JOBS: Held = {}
Readings = tuple[float | None, float | None, float | None]  # util_pct, mem_used_mb, mem_total_mb
Fractions = tuple[float | None, float | None]


def age_s(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def unattributed_of(node: NodeInfo, held: Held) -> set[int] | tuple[()]:
    """GPUs Slurm counts as used that no job's IDX names (see :mod:`xhpc.placement.snapshot`).

    Always indexes of the node (``0 <= i < gpus_total``) and never one in ``held``.
    """
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


def is_foreign(gpu: GpuProbe) -> bool:
    return any(
        p.job_id is None and (p.mem_used_mb is None or p.mem_used_mb > 0) for p in gpu.processes
    )


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
_SHARED_MAX = 256  # GPU indexes (and GPUs per node) with a shared view
_shared: dict[tuple[int, bool], GpuView] = {}
_idle_rows: dict[int, tuple[GpuView, ...]] = {}
RANGES: dict[int, frozenset[int]] = {}  # gpus_total -> its indexes (gpu_indexes)


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


def gpu_indexes(total: int) -> frozenset[int]:
    """``frozenset(range(total))``, shared."""
    indexes = RANGES.get(total)
    if indexes is None:
        indexes = frozenset(range(total))
        if total < _SHARED_MAX:
            RANGES[total] = indexes
    return indexes


class Sources:
    """The inputs of one build, from which a node's view is built when it is first read.

    Its containers are its own (``build_snapshot`` copies or builds them), so a view built later
    is the view of the moment of the build; what they hold are frozen models. A node's view is
    built once (``views``); ``all`` builds the others and keeps the same objects.
    """

    __slots__ = (
        "by_name",
        "fractions",
        "held",
        "index",
        "names",
        "now",
        "probe_ttl_s",
        "probed",
        "probes",
        "reserved",
        "usable",
        "views",
    )

    def __init__(
        self,
        by_name: dict[str, NodeInfo],
        names: list[str],
        held: dict[str, dict[int, tuple[str, ...]]],
        reserved: dict[str, int],
        probes: dict[str, ProbeReport],
        now: datetime,
        probe_ttl_s: float,
    ) -> None:
        self.by_name = by_name
        self.names = names
        self.index = dict(zip(names, range(len(names)), strict=True))
        self.held = held
        self.reserved = reserved
        self.probes = probes
        self.now = now
        self.probe_ttl_s = probe_ttl_s
        self.views: list[NodeView | None] = [None] * len(names)
        # shared by the views of this build (and of its apply_reservations children)
        self.usable: dict[tuple[str, tuple[str, ...]], bool] = {}
        self.fractions: dict[Readings, Fractions] = {}
        # probed GPUs no job holds, by value: their view
        self.probed: dict[tuple[object, ...], GpuView] = {}

    def node(self, name: str) -> NodeView | None:
        i = self.index.get(name)
        return None if i is None else self.view(i)

    def all(self) -> tuple[NodeView, ...]:
        views, build = self.views, self._build_view
        with gc_paused():  # ~100k long-lived objects at 10k nodes
            for i, name in enumerate(self.names):
                if views[i] is None:
                    views[i] = build(name)
            return tuple(views)  # type: ignore[arg-type]  # (no None left)

    def view(self, i: int) -> NodeView:
        built = self.views[i]
        if built is None:
            built = self.views[i] = self._build_view(self.names[i])
        return built

    def with_reserved(self, extra: Mapping[str, int]) -> Sources:
        """The same inputs with ``extra`` more GPUs reserved on these nodes (known ones)."""
        child = Sources.__new__(Sources)
        for slot in Sources.__slots__:
            setattr(child, slot, getattr(self, slot))
        child.reserved = dict(self.reserved)
        child.views = list(self.views)  # the other nodes' views stay the same objects
        for name, count in extra.items():
            child.reserved[name] = child.reserved.get(name, 0) + count
            child.views[self.index[name]] = None
        return child

    def usable_of(self, node: NodeInfo) -> bool:
        key = (node.state, node.state_flags)
        usable = self.usable.get(key)
        if usable is None:
            usable = self.usable[key] = node.usable
        return usable

    def _build_view(self, name: str) -> NodeView:
        node = self.by_name[name]
        total = node.gpus_total
        held_here = self.held.get(name) or NO_JOBS
        unattributed = (
            unattributed_of(node, held_here) if node.gpus_used or node.gpus_used_idx else ()
        )
        probe = self.probes.get(name)
        probe_age = age_s(self.now, probe.taken_at) if probe is not None else None
        stale = probe_age is not None and probe_age > self.probe_ttl_s
        seen = {g.index: g for g in probe.gpus} if probe is not None and not stale else None
        if seen:
            gpus = self._probed_row(total, held_here, unattributed, seen)
        elif held_here or unattributed:  # the shared idle row, with the held GPUs replaced
            row = list(_idle_row(total))
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
            for index in unattributed:
                if index not in held_here:
                    row[index] = _unheld(index, True)
            gpus = tuple(row)
        else:
            gpus = _idle_row(total)
        return _node_view(
            {
                "name": name,
                "address": node.address,
                "state": node.state,
                "state_flags": node.state_flags,
                "reason": node.reason,
                "usable": self.usable_of(node),
                "partitions": node.partitions,
                "gpu_type": node.gpu_type,
                "gpus": gpus,
                "reserved": self.reserved.get(name, 0),
                "probe_age_s": probe_age,
                "probe_stale": stale,
            }
        )

    def _probed_row(
        self,
        total: int,
        held_here: Held,
        unattributed: Collection[int],
        seen: Mapping[int, GpuProbe],
    ) -> tuple[GpuView, ...]:
        row: list[GpuView] = []
        for index in range(total):
            ids = held_here.get(index, ())
            unatt = index in unattributed
            gpu = seen.get(index)
            if gpu is None:
                if ids:
                    view = _gpu_slurm(
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
                else:
                    view = _unheld(index, unatt)
                row.append(view)
                continue
            healthy = gpu.healthy
            foreign = bool(gpu.processes) and is_foreign(gpu)
            error = gpu.error
            util_pct, mem_used, mem_total = gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb
            key = None
            if not ids:  # the view of every equal GPU of this build (zeros by repr: 0.0 vs -0.0)
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
                shared = self.probed.get(key)
                if shared is not None:
                    row.append(shared)
                    continue
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
            if key is not None:
                self.probed[key] = view
            row.append(view)
        return tuple(row)
