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

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime

from pydantic import Field, model_validator

from xhpc.models import Frozen, GpuProbe, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement.hostlist import expand_hostlist
from xhpc.slurm.parse import parse_gres

#: Job states in which a job holds its nodes' resources.
HOLDING_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
    }
)


class GpuView(Frozen):
    """One GPU of a node: who holds it in Slurm, and (fresh probes only) what the probe saw."""

    index: int
    slurm_jobs: tuple[str, ...] = ()
    unattributed: bool = False  # Slurm counts it used, no job's IDX names it
    healthy: bool = True
    foreign: bool = False  # GPU memory held by a process with no Slurm job
    util_pct: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    error: str | None = None

    @property
    def allocated(self) -> bool:
        """Held by Slurm (by a known job, or counted used without an index)."""
        return bool(self.slurm_jobs) or self.unattributed

    @property
    def clean(self) -> bool:
        return self.healthy and not self.foreign

    @property
    def idle(self) -> bool:
        """Neither allocated by Slurm nor unhealthy nor holding foreign memory."""
        return not self.allocated and self.clean


def _fraction(value: float) -> float:
    return min(max(value, 0.0), 1.0)


class NodeView(Frozen):
    """One node as placement sees it."""

    name: str
    address: str
    state: str
    state_flags: tuple[str, ...] = ()
    reason: str | None = None
    usable: bool
    partitions: tuple[str, ...] = ()
    gpu_type: str | None = None
    gpus: tuple[GpuView, ...] = ()
    reserved: int = Field(default=0, ge=0)
    probe_age_s: float | None = None
    probe_stale: bool = False

    @property
    def gpus_total(self) -> int:
        return len(self.gpus)

    @property
    def allocated(self) -> int:
        return sum(1 for g in self.gpus if g.allocated)

    @property
    def unhealthy(self) -> int:
        return sum(1 for g in self.gpus if not g.healthy)

    @property
    def foreign(self) -> int:
        return sum(1 for g in self.gpus if g.foreign)

    @property
    def idle(self) -> int:
        return sum(1 for g in self.gpus if g.idle)

    @property
    def free(self) -> int:
        """GPUs a new job may get: idle ones less the open reservations on this node."""
        return max(0, self.idle - self.reserved)

    @property
    def tainted(self) -> bool:
        """A fresh probe saw an unhealthy GPU or foreign GPU memory: sort after clean nodes."""
        return any(not g.clean for g in self.gpus)

    @property
    def probe_fresh(self) -> bool:
        return self.probe_age_s is not None and not self.probe_stale

    @property
    def load(self) -> float:
        """0..1: mean of (mean GPU utilisation, mean memory fraction) over what a fresh probe read.

        0.0 when no fresh probe data exists (no evidence of load). Non-finite readings are ignored.
        """
        utils = [
            _fraction(g.util_pct / 100.0)
            for g in self.gpus
            if g.util_pct is not None and math.isfinite(g.util_pct)
        ]
        mems = [
            _fraction(g.mem_used_mb / g.mem_total_mb)
            for g in self.gpus
            if g.mem_used_mb is not None
            and g.mem_total_mb is not None
            and math.isfinite(g.mem_used_mb)
            and math.isfinite(g.mem_total_mb)
            and g.mem_total_mb > 0
        ]
        parts = [sum(values) / len(values) for values in (utils, mems) if values]
        return sum(parts) / len(parts) if parts else 0.0


class ClusterSnapshot(Frozen):
    """Every node, sorted by name; ages of the sources it was built from."""

    taken_at: datetime
    nodes: tuple[NodeView, ...] = ()
    probe_ttl_s: float = 30.0
    sinfo_age_s: float | None = None
    squeue_age_s: float | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSnapshot:
        names = Counter(n.name for n in self.nodes)
        if len(names) != len(self.nodes):
            dup = sorted(name for name, count in names.items() if count > 1)
            raise ValueError(f"duplicate node names in snapshot: {', '.join(dup[:5])}")
        return self

    def node(self, name: str) -> NodeView | None:
        """The node called ``name`` (a linear scan; placement uses its own index)."""
        return next((n for n in self.nodes if n.name == name), None)


def _age_s(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _job_gpus(jobs: Sequence[JobInfo]) -> dict[str, dict[int, list[str]]]:
    """node -> GPU index -> ids of the resource-holding jobs whose gres_detail names it."""
    held: dict[str, dict[int, list[str]]] = {}
    for job in jobs:
        if job.state.upper() not in HOLDING_STATES or not job.gres_detail:
            continue
        hosts = expand_hostlist(job.nodes) or ((job.batch_host,) if job.batch_host else ())
        if len(hosts) == len(job.gres_detail):
            pairs = [(h, parse_gres(d)[2]) for h, d in zip(hosts, job.gres_detail, strict=True)]
        elif len(hosts) == 1:
            pairs = [(hosts[0], job.gpus_idx)]
        else:  # cannot align details with nodes: sinfo's used counts cover these GPUs
            continue
        for host, indexes in pairs:
            per_gpu = held.setdefault(host, {})
            for index in indexes:
                per_gpu.setdefault(index, []).append(job.job_id)
    return held


def _is_foreign(gpu: GpuProbe) -> bool:
    return any(
        p.job_id is None and (p.mem_used_mb is None or p.mem_used_mb > 0) for p in gpu.processes
    )


def _node_view(
    node: NodeInfo,
    held: Mapping[int, list[str]],
    reserved: int,
    probe: ProbeReport | None,
    now: datetime,
    probe_ttl_s: float,
) -> NodeView:
    total = node.gpus_total
    busy = {i for i in held if 0 <= i < total} | {i for i in node.gpus_used_idx if 0 <= i < total}
    missing = max(0, node.gpus_used - len(busy))
    unattributed = {i for i in node.gpus_used_idx if 0 <= i < total and i not in held}
    for index in range(total - 1, -1, -1):  # unexplained use: highest free indexes first
        if missing == 0:
            break
        if index not in busy:
            unattributed.add(index)
            missing -= 1

    probe_age = _age_s(now, probe.taken_at) if probe is not None else None
    stale = probe_age is not None and probe_age > probe_ttl_s
    seen = {g.index: g for g in probe.gpus} if probe is not None and not stale else {}

    gpus: list[GpuView] = []
    for index in range(total):
        jobs = tuple(held.get(index, ()))
        gpu = seen.get(index)
        if gpu is None:
            gpus.append(GpuView(index=index, slurm_jobs=jobs, unattributed=index in unattributed))
            continue
        gpus.append(
            GpuView(
                index=index,
                slurm_jobs=jobs,
                unattributed=index in unattributed,
                healthy=gpu.healthy,
                foreign=_is_foreign(gpu),
                util_pct=gpu.util_pct,
                mem_used_mb=gpu.mem_used_mb,
                mem_total_mb=gpu.mem_total_mb,
                error=gpu.error,
            )
        )
    return NodeView(
        name=node.name,
        address=node.address,
        state=node.state,
        state_flags=node.state_flags,
        reason=node.reason,
        usable=node.usable,
        partitions=node.partitions,
        gpu_type=node.gpu_type,
        gpus=tuple(gpus),
        reserved=reserved,
        probe_age_s=probe_age,
        probe_stale=stale,
    )


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
    """
    if now.tzinfo is None:
        raise ValueError("build_snapshot: `now` must be timezone-aware")
    held = _job_gpus(jobs)
    reserved: dict[str, int] = {}
    for r in reservations:
        reserved[r.node] = reserved.get(r.node, 0) + max(0, r.gpus)
    probes = probes or {}
    views = [
        _node_view(
            node,
            held.get(node.name, {}),
            reserved.get(node.name, 0),
            probes.get(node.name),
            now,
            probe_ttl_s,
        )
        for node in sorted({n.name: n for n in nodes}.values(), key=lambda n: n.name)
    ]
    return ClusterSnapshot(
        taken_at=now,
        nodes=tuple(views),
        probe_ttl_s=probe_ttl_s,
        sinfo_age_s=_age_s(now, sinfo_at),
        squeue_age_s=_age_s(now, squeue_at),
    )
