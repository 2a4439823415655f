"""Seeded synthetic clusters for the placement tests and ``bench/placement.py`` (pure).

They go through the real ingest path: sinfo-like :class:`NodeInfo`, squeue-like :class:`JobInfo`
with ``gres_detail`` IDX (some jobs span two nodes as a hostlist), open reservations and probe
reports, then :func:`build_snapshot`. Features, each with a small seeded probability: drained and
down nodes, several partitions and GPU types, GPUs sinfo counts as used that no job explains,
pending jobs, stale probes, lost GPUs, foreign GPU memory. Probe readings are coarse (multiples of
10%) so that ties, and with them the name tie-break, are common.

:func:`sinfo_text` / :func:`squeue_text` / :func:`scontrol_jobs_text` print the nodes and jobs as
the narrow listings the client asks for (``xhpc.slurm.text``), :func:`sinfo_json` /
:func:`squeue_json` as ``sinfo --json`` / ``squeue --json`` do (lines and records copied from real
captures), so that the bench can time the ingest from Slurm's text and the tests can check that
the parsers give the inputs back.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from xhpc.models import (
    GpuProbe,
    GpuProcess,
    JobInfo,
    NodeInfo,
    ProbeReport,
    Reservation,
)
from xhpc.placement.hostlist import expand_hostlist
from xhpc.placement.snapshot import ClusterSnapshot, build_snapshot
from xhpc.slurm.text import SEP

PARTITIONS = ("gpu", "long", "debug")
GPU_TYPES = ("a100", "h100")


@dataclass(frozen=True)
class SyntheticInputs:
    nodes: tuple[NodeInfo, ...]
    jobs: tuple[JobInfo, ...]
    reservations: tuple[Reservation, ...]
    now: datetime
    probe_ttl_s: float
    probes: dict[str, ProbeReport] = field(default_factory=dict)


def _idx(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in indexes)


def synthetic_inputs(
    n_nodes: int,
    gpus_per_node: int | Sequence[int] = 8,
    *,
    seed: int,
    now: datetime,
    busy: float = 0.5,
    probe_ttl_s: float = 30.0,
) -> SyntheticInputs:
    """Nodes ``n00000``.. with random partial use; ``busy`` is the mean fraction of GPUs in use."""
    rng = random.Random(seed)
    sizes = (gpus_per_node,) if isinstance(gpus_per_node, int) else tuple(gpus_per_node)
    width = max(2, len(str(max(n_nodes - 1, 0))))
    nodes: list[NodeInfo] = []
    jobs: list[JobInfo] = []
    reservations: list[Reservation] = []
    probes: dict[str, ProbeReport] = {}
    # per node: the jobs' GPU indexes, so that neighbours can share one two-node job
    fragments: list[list[list[int]]] = []
    for i in range(n_nodes):
        name = f"n{i:0{width}d}"
        total = rng.choice(sizes)
        used = sorted(
            rng.sample(range(total), k=min(total, round(rng.random() * 2 * busy * total)))
        )
        frags: list[list[int]] = []
        while used:
            take = rng.randint(1, min(4, len(used)))
            frags.append(used[:take])
            used = used[take:]
        fragments.append(frags)
        roll = rng.random()
        flags: tuple[str, ...] = ("DRAIN",) if roll < 0.04 else ()
        n_used = sum(len(f) for f in frags)
        state = "DOWN" if 0.04 <= roll < 0.05 else ("MIXED" if n_used else "IDLE")
        extra = 1 if rng.random() < 0.03 and n_used < total else 0
        part_roll = rng.random()
        parts = (
            ("debug",) if part_roll < 0.1 else (("gpu", "long") if part_roll < 0.3 else ("gpu",))
        )
        nodes.append(
            NodeInfo(
                name=name,
                address=f"10.0.{i // 250}.{i % 250 + 1}",
                state=state,
                state_flags=flags,
                partitions=parts,
                gpus_total=total,
                gpus_used=n_used + extra,
                gpu_type=None if rng.random() < 0.1 else rng.choice(GPU_TYPES),
                reason="synthetic" if flags or state == "DOWN" else None,
            )
        )
        if total and rng.random() < 0.03:
            reservations.append(
                Reservation(replica_id=f"r{i}", node=name, gpus=rng.randint(1, 2), created_at=now)
            )
        if rng.random() < 0.7:
            probes[name] = _probe(rng, name, total, now, probe_ttl_s)

    job_id = 1000
    for i, frags in enumerate(fragments):
        for k, frag in enumerate(frags):
            job_id += 1
            host = nodes[i].name
            if k == 0 and i + 1 < n_nodes and fragments[i + 1] and rng.random() < 0.1:
                other = fragments[i + 1].pop()
                hostlist = f"n[{host[1:]}-{nodes[i + 1].name[1:]}]"
                detail = (
                    f"gpu:{len(frag)}(IDX:{_idx(frag)})",
                    f"gpu:{len(other)}(IDX:{_idx(other)})",
                )
                jobs.append(_job(job_id, hostlist, host, detail, (*frag, *other)))
            else:
                jobs.append(_job(job_id, host, host, (f"gpu:{len(frag)}(IDX:{_idx(frag)})",), frag))
    for _ in range(max(1, n_nodes // 50)):
        job_id += 1
        jobs.append(JobInfo(job_id=str(job_id), raw_job_id=job_id, name="queued", state="PENDING"))
    return SyntheticInputs(
        nodes=tuple(nodes),
        jobs=tuple(jobs),
        reservations=tuple(reservations),
        probes=probes,
        now=now,
        probe_ttl_s=probe_ttl_s,
    )


def _job(
    job_id: int, hosts: str, batch_host: str, detail: tuple[str, ...], idx: Sequence[int]
) -> JobInfo:
    return JobInfo(
        job_id=str(job_id),
        raw_job_id=job_id,
        name=f"job{job_id}",
        state="RUNNING",
        nodes=hosts,
        batch_host=batch_host,
        gres_detail=detail,
        gpus_idx=tuple(idx),
    )


def _probe(rng: random.Random, name: str, total: int, now: datetime, ttl_s: float) -> ProbeReport:
    stale = rng.random() < 0.15
    taken = now - timedelta(seconds=ttl_s * 2 if stale else rng.random() * ttl_s * 0.5)
    gpus = []
    for index in range(total):
        lost = rng.random() < 0.01
        foreign = rng.random() < 0.01
        gpus.append(
            GpuProbe(
                index=index,
                name="synthetic",
                mem_total_mb=81920.0,
                mem_used_mb=None if lost else 8192.0 * rng.randint(0, 10),
                util_pct=None if lost else 10.0 * rng.randint(0, 10),
                healthy=not lost,
                error="GPU is lost" if lost else None,
                processes=(GpuProcess(pid=4242, mem_used_mb=1024.0),) if foreign else (),
            )
        )
    return ProbeReport(node=name, taken_at=taken, backend="fake", gpus=tuple(gpus))


def synthetic_snapshot(
    n_nodes: int,
    gpus_per_node: int | Sequence[int] = 8,
    *,
    seed: int,
    now: datetime,
    busy: float = 0.5,
    probe_ttl_s: float = 30.0,
) -> ClusterSnapshot:
    """:func:`synthetic_inputs` passed through :func:`build_snapshot`."""
    inputs = synthetic_inputs(
        n_nodes, gpus_per_node, seed=seed, now=now, busy=busy, probe_ttl_s=probe_ttl_s
    )
    return build_snapshot(
        inputs.nodes,
        inputs.jobs,
        inputs.reservations,
        inputs.probes,
        now=inputs.now,
        probe_ttl_s=inputs.probe_ttl_s,
    )


# -- the same inputs as the text sinfo/squeue print ------------------------------------------------
def _meta(template: Mapping[str, Any]) -> dict[str, Any]:
    return {key: template[key] for key in ("meta", "errors") if key in template}


def sinfo_json(nodes: Sequence[NodeInfo], capture: Mapping[str, Any]) -> str:
    """``sinfo --json`` text for ``nodes``: each record a copy of ``capture``'s first node.

    ``capture`` is a parsed real ``sinfo --json`` output (``tests/data/slurm/sinfo-*.json``), so
    the text carries every field Slurm prints; the fields xhpc reads come from ``nodes``, and
    :func:`~xhpc.slurm.parse.parse_sinfo_json` of the text gives ``nodes`` back (sorted by name).
    """
    template = capture["nodes"][0]
    records = []
    for node in nodes:
        typed = f"gpu:{node.gpu_type}:" if node.gpu_type else "gpu:"
        records.append(
            {
                **template,
                "name": node.name,
                "hostname": node.name,
                "address": node.address,
                "state": node.state.lower(),
                "state_flags": list(node.state_flags),
                "partitions": list(node.partitions),
                "gres": f"{typed}{node.gpus_total}" if node.gpus_total else "",
                "gres_used": (
                    f"{typed}{node.gpus_used}"
                    + (f"(IDX:{_idx(node.gpus_used_idx)})" if node.gpus_used_idx else "")
                    if node.gpus_total
                    else ""
                ),
                "cpus": node.cpus,
                "reason": node.reason or "",
            }
        )
    return json.dumps({**_meta(capture), "nodes": records}, indent=2)


def squeue_json(jobs: Sequence[JobInfo], capture: Mapping[str, Any]) -> str:
    """``squeue --json`` text for plain (not array, not het) ``jobs``, like :func:`sinfo_json`.

    ``capture`` is a parsed real ``squeue --json`` output with a running job that holds a node
    (``tests/data/slurm/squeue-mixed.json``); :func:`~xhpc.slurm.parse.parse_squeue_json` of the
    text gives ``jobs`` back.
    """
    running = next(j for j in capture["jobs"] if j.get("job_resources"))
    resources = running["job_resources"]
    per_node = resources["allocated_nodes"][0]
    no_val = 4294967294
    records = []
    for job in jobs:
        hosts = expand_hostlist(job.nodes)
        records.append(
            {
                **running,
                "job_id": job.raw_job_id,
                "name": job.name,
                "job_state": job.state,
                "state_reason": job.reason or "None",
                "user_name": job.user or "",
                "partition": job.partition or "",
                "nodes": job.nodes or "",
                "batch_host": job.batch_host or "",
                "comment": job.comment or "",
                "gres_detail": list(job.gres_detail),
                "het_job_id": 0,
                "het_job_offset": 0,
                "array_job_id": 0,
                "array_task_id": None,
                "array_task_string": "",
                "time_limit": no_val if job.time_limit_min is None else job.time_limit_min,
                "start_time": int(job.start_time.timestamp()) if job.start_time else 0,
                "restart_cnt": job.restart_count,
                "job_resources": (
                    {
                        **resources,
                        "nodes": job.nodes,
                        "allocated_hosts": len(hosts),
                        "allocated_nodes": [{**per_node, "nodename": h} for h in hosts],
                    }
                    if hosts
                    else {}
                ),
            }
        )
    return json.dumps({**_meta(capture), "jobs": records}, indent=2)


# -- the same inputs as the narrow listings the client asks for (xhpc.slurm.text) --------------
def _template(capture: str, first: str) -> list[str]:
    """The fields of the first line of a real capture whose first field is ``first``."""
    for line in capture.splitlines():
        fields = line.split(SEP)
        if fields[0] == first:
            return fields
    raise ValueError(f"no line for {first!r} in the capture")


def sinfo_text(nodes: Sequence[NodeInfo], capture: str) -> str:
    """``sinfo -O`` text (:data:`~xhpc.slurm.text.SINFO_FIELDS`) for ``nodes``: each line a copy
    of ``capture``'s first (``tests/data/slurm/sinfo-nodes.txt``) with xhpc's fields filled in,
    one per node and partition, partition-major as ``--sort=#P`` prints them;
    :func:`~xhpc.slurm.text.parse_sinfo_text` gives ``nodes`` back."""
    template = capture.splitlines()[0].split(SEP)
    order: list[str] = []
    for node in nodes:
        order.extend(p for p in node.partitions if p not in order)
    lines = []
    for partition in order:
        for node in nodes:
            if partition not in node.partitions:
                continue
            typed = f"gpu:{node.gpu_type}:" if node.gpu_type else "gpu:"
            fields = list(template)
            fields[0] = fields[-1] = node.name
            fields[1] = node.address
            fields[2] = "+".join((node.state, *node.state_flags)).lower()
            fields[3] = partition
            fields[4] = f"{typed}{node.gpus_total}" if node.gpus_total else "(null)"
            fields[5] = (
                f"{typed}{node.gpus_used}"
                + (f"(IDX:{_idx(node.gpus_used_idx)})" if node.gpus_used_idx else "")
                if node.gpus_total
                else "(null)"
            )
            fields[6] = f"0/{node.cpus}/0/{node.cpus}"
            fields[7] = node.reason or "none"
            lines.append(SEP.join(fields))
    return "".join(line + "\n" for line in lines)


def _clock(minutes: int) -> str:
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    clock = f"{hours}:{mins:02d}:00" if hours or days else f"{mins}:00"
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else clock


def squeue_text(jobs: Sequence[JobInfo], capture: str) -> str:
    """``squeue -O`` text (:data:`~xhpc.slurm.text.SQUEUE_FIELDS`) for plain (not array, not
    het) batch ``jobs``: each line a copy of a running job's in ``capture``
    (``tests/data/slurm/squeue-jobs.txt``); with :func:`scontrol_jobs_text` of the same jobs,
    :func:`~xhpc.slurm.text.parse_squeue_text` gives ``jobs`` back."""
    running = next(line for line in capture.splitlines() if f"{SEP}RUNNING{SEP}" in line)
    template = running.split(SEP)
    lines = []
    for job in jobs:
        fields = list(template)
        jid = str(job.raw_job_id)
        fields[0] = fields[4] = fields[-1] = jid
        fields[1] = job.state
        fields[2] = fields[3] = fields[5] = "N/A"
        fields[6] = job.user or ""
        fields[7] = job.partition or ""
        fields[8] = job.nodes or ""
        fields[9] = job.batch_host or "n/a"
        fields[10] = "1"
        fields[11] = "UNLIMITED" if job.time_limit_min is None else _clock(job.time_limit_min)
        fields[12] = str(int(job.start_time.timestamp())) if job.start_time else "N/A"
        fields[13] = str(job.restart_count)
        fields[14] = job.reason or "None"
        fields[15] = job.name
        fields[16] = job.comment or ""
        lines.append(SEP.join(fields))
    return "".join(line + "\n" for line in lines)


def scontrol_jobs_text(jobs: Sequence[JobInfo], capture: str) -> str:
    """``scontrol -d -o show job`` text for ``jobs`` (their GPU detail per node): each line a copy
    of a running job's in ``capture`` (``tests/data/slurm/scontrol-show-job.txt``)."""
    running = next(line for line in capture.splitlines() if "JobState=RUNNING" in line)
    head, _, rest = running.partition(" JOB_GRES=")
    tail = rest[rest.index(" MinCPUsNode=") :]
    head = head.split(" ", 2)[2]  # after JobId= and JobName=
    lines = []
    for job in jobs:
        hosts = expand_hostlist(job.nodes)
        groups = "".join(
            f" Nodes={h} CPU_IDs=0 Mem=0 GRES={d}"
            for h, d in zip(hosts, job.gres_detail, strict=False)
        )
        lines.append(
            f"JobId={job.raw_job_id} JobName={job.name} {head} "
            f"JOB_GRES=gpu:{len(job.gpus_idx)} {groups}{tail}"
        )
    return "".join(line + "\n" for line in lines)
