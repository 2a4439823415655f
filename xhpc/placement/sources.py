"""The inputs of one snapshot build, and the node views built from them when first read (pure).

:func:`~xhpc.placement.snapshot.build_snapshot` keeps its inputs in a :class:`Sources` and
computes only the placement arrays; the snapshot's :class:`NodeView` (and its :class:`GpuView`
row) of a node is built from the :class:`Sources` when it is first read. The rules are the
snapshot module's; the helpers both use are here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Protocol

from xhpc.models import GpuProbe, ProbeReport
from xhpc.placement.views import GpuView, NodeView

Held = Mapping[int, tuple[str, ...]]  # GPU index -> ids of the jobs holding it
NO_JOBS: Held = {}


class SlurmNodeLike(Protocol):
    """What placement reads of a node (:class:`~xhpc.models.NodeInfo`; tests pass others)."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def state_flags(self) -> tuple[str, ...]: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def partitions(self) -> tuple[str, ...]: ...
    @property
    def gpu_type(self) -> str | None: ...
    @property
    def gpus_total(self) -> int: ...
    @property
    def gpus_used(self) -> int: ...
    @property
    def gpus_used_idx(self) -> tuple[int, ...]: ...
    @property
    def usable(self) -> bool: ...


class SlurmJobLike(Protocol):
    """What placement reads of a job (:class:`~xhpc.models.JobInfo`; tests pass others)."""

    @property
    def job_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def nodes(self) -> str | None: ...
    @property
    def batch_host(self) -> str | None: ...
    @property
    def gres_detail(self) -> tuple[str, ...]: ...
    @property
    def gpus_idx(self) -> tuple[int, ...]: ...


def age_s(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def unattributed_of(node: SlurmNodeLike, held: Held) -> set[int] | tuple[()]:
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


class Sources:
    """The inputs of one build, from which a node's view is built when it is first read.

    Its containers are its own (``build_snapshot`` copies or builds them), so a view built later
    is the view of the moment of the build; what they hold is never changed. A node's view is
    built once (``views``); :meth:`all` builds the others and keeps the same objects. Views are
    immutable, so GPUs that read the same (no job, no fresh probe, or the same probe readings)
    share one view within a build and its :meth:`with_reserved` children.
    """

    __slots__ = (
        "by_name",
        "held",
        "index",
        "names",
        "now",
        "probe_ttl_s",
        "probes",
        "reserved",
        "shared",
        "views",
    )

    def __init__(
        self,
        by_name: dict[str, SlurmNodeLike],
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
        self.shared: dict[tuple[object, ...], GpuView] = {}  # GPUs no job holds, by value

    def node(self, name: str) -> NodeView | None:
        i = self.index.get(name)
        return None if i is None else self.view(i)

    def all(self) -> tuple[NodeView, ...]:
        return tuple(self.view(i) for i in range(len(self.names)))

    def view(self, i: int) -> NodeView:
        built = self.views[i]
        if built is None:
            built = self.views[i] = self._build_view(self.names[i])
        return built

    def with_reserved(self, extra: Mapping[str, int]) -> Sources:
        """The same inputs with ``extra`` more GPUs reserved on these (known) nodes."""
        child = Sources.__new__(Sources)
        for slot in Sources.__slots__:
            setattr(child, slot, getattr(self, slot))
        child.reserved = dict(self.reserved)
        child.views = list(self.views)  # the other nodes' views stay the same objects
        for name, count in extra.items():
            child.reserved[name] = child.reserved.get(name, 0) + count
            child.views[self.index[name]] = None
        return child

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
        seen = {g.index: g for g in probe.gpus} if probe is not None and not stale else {}
        gpus = tuple(
            self._gpu(index, held_here.get(index, ()), index in unattributed, seen.get(index))
            for index in range(total)
        )
        return NodeView(
            name=name,
            address=node.address,
            state=node.state,
            state_flags=node.state_flags,
            reason=node.reason,
            usable=node.usable,
            partitions=node.partitions,
            gpu_type=node.gpu_type,
            gpus=gpus,
            reserved=self.reserved.get(name, 0),
            probe_age_s=probe_age,
            probe_stale=stale,
        )

    def _gpu(
        self, index: int, jobs: tuple[str, ...], unattributed: bool, gpu: GpuProbe | None
    ) -> GpuView:
        if gpu is None:
            if jobs:
                return GpuView(index=index, slurm_jobs=jobs, unattributed=unattributed)
            key: tuple[object, ...] = (index, unattributed)
            view = self.shared.get(key)
            if view is None:
                view = self.shared[key] = GpuView(
                    index=index, slurm_jobs=(), unattributed=unattributed
                )
            return view
        foreign = bool(gpu.processes) and is_foreign(gpu)
        readings = (gpu.util_pct, gpu.mem_used_mb, gpu.mem_total_mb)
        # (zeros by repr: 0.0 and -0.0 differ)
        key = (
            index,
            unattributed,
            gpu.healthy,
            foreign,
            gpu.error,
            *(r or repr(r) for r in readings),
        )
        if not jobs and (view := self.shared.get(key)) is not None:
            return view
        view = GpuView(
            index=index,
            slurm_jobs=jobs,
            unattributed=unattributed,
            healthy=gpu.healthy,
            foreign=foreign,
            util_pct=gpu.util_pct,
            mem_used_mb=gpu.mem_used_mb,
            mem_total_mb=gpu.mem_total_mb,
            error=gpu.error,
        )
        if not jobs:
            self.shared[key] = view
        return view
