"""The inputs of one snapshot build, and the node views built from them when first read (pure).

:func:`~xhpc.placement.snapshot.build_snapshot` keeps its inputs in a :class:`Sources` and
computes only the placement arrays; the snapshot's :class:`NodeView` (and its :class:`GpuView`
row) of a node is built from the :class:`Sources` when it is first read. The rules are the
snapshot module's; the helpers both use are here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Protocol

from xhpc.models import HOLDING_STATES, GpuProbe, ProbeReport
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.views import GpuView, NodeView
from xhpc.slurm.parse import parse_gres

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


def unattributed_of(node: SlurmNodeLike, held: Mapping[int, object]) -> set[int] | tuple[()]:
    """GPUs Slurm counts as used that no job's IDX names (see :mod:`xhpc.placement.snapshot`).

    Always indexes of the node (``0 <= i < gpus_total``) and never one in ``held``.
    """
    return unattributed_in(node.gpus_total, node.gpus_used, node.gpus_used_idx, held)


def unattributed_in(
    total: int, used: int, used_idx: tuple[int, ...], held: Mapping[int, object]
) -> set[int] | tuple[()]:
    """:func:`unattributed_of` a node of these ``gpus_total``, ``gpus_used``, ``gpus_used_idx``."""
    busy: Collection[int]
    unattributed: set[int]
    if used_idx:
        busy = {i for i in held if 0 <= i < total} | {i for i in used_idx if 0 <= i < total}
        unattributed = {i for i in used_idx if 0 <= i < total and i not in held}
    elif not held or (min(held) >= 0 and max(held) < total):
        busy, unattributed = held, set()  # (the usual case: no set to build)
    else:
        busy, unattributed = {i for i in held if 0 <= i < total}, set()
    missing = max(0, used - len(busy))
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


def job_gpus(jobs: Iterable[SlurmJobLike]) -> dict[str, dict[int, tuple[str, ...]]]:
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


class Sources:
    """The inputs of one build, from which a node's view is built when it is first read.

    Its containers are its own (the builder copies or builds them), so a view built later is the
    view of the moment of the build; what they hold is never changed. ``held`` (per node, the
    jobs on each GPU) is computed from the jobs when the first view is built. A node's view is
    built once (``views``); :meth:`all` builds the others and keeps the same objects. Views are
    immutable, so GPUs that read the same (no job, no fresh probe, or the same probe readings)
    share one view within a build and its :meth:`with_reserved` children.
    """

    __slots__ = (
        "_held",
        "index",
        "jobs",
        "names",
        "nodes",
        "now",
        "probe_ttl_s",
        "probes",
        "reserved",
        "shared",
        "views",
    )

    def __init__(
        self,
        nodes: list[SlurmNodeLike],
        names: tuple[str, ...],
        index: Mapping[str, int],
        jobs: tuple[SlurmJobLike, ...],
        reserved: dict[str, int],
        probes: dict[str, ProbeReport],
        now: datetime,
        probe_ttl_s: float,
    ) -> None:
        self.nodes = nodes  # per name, in the order of ``names``
        self.names = names
        self.index = index
        self.jobs = jobs
        self._held: dict[str, dict[int, tuple[str, ...]]] | None = None
        self.reserved = reserved
        self.probes = probes
        self.now = now
        self.probe_ttl_s = probe_ttl_s
        self.views: dict[int, NodeView] = {}  # row -> its view, once built
        self.shared: dict[tuple[object, ...], GpuView] = {}  # GPUs no job holds, by value

    @property
    def held(self) -> dict[str, dict[int, tuple[str, ...]]]:
        """Node -> GPU index -> the jobs holding it (:func:`job_gpus`), computed once."""
        held = self._held
        if held is None:
            held = self._held = job_gpus(self.jobs)
        return held

    def node(self, name: str) -> NodeView | None:
        i = self.index.get(name)
        return None if i is None else self.view(i)

    def all(self) -> tuple[NodeView, ...]:
        return tuple(self.view(i) for i in range(len(self.names)))

    def view(self, i: int) -> NodeView:
        built = self.views.get(i)
        if built is None:
            built = self.views[i] = self._build_view(i)
        return built

    def with_reserved(self, extra: Mapping[str, int]) -> Sources:
        """The same inputs with ``extra`` more GPUs reserved on these (known) nodes."""
        child = Sources.__new__(Sources)
        for slot in Sources.__slots__:
            setattr(child, slot, getattr(self, slot))
        child.reserved = dict(self.reserved)
        child.views = dict(self.views)  # the other nodes' views stay the same objects
        for name, count in extra.items():
            child.reserved[name] = child.reserved.get(name, 0) + count
            child.views.pop(self.index[name], None)
        return child

    def _build_view(self, i: int) -> NodeView:
        name, node = self.names[i], self.nodes[i]
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
