"""build_snapshot gives what the plain eager one gave, views and arrays alike.

`reference_build` is build_snapshot as it was before it was made fast (bench/placement.py): one
GpuView per GPU, one NodeView per node, all built at once, arrays from the views' properties.
build_snapshot must give equal views (equal dumps and JSON, the same `model_fields_set` and field
types at every level) and arrays equal to the properties, on the captured Slurm output (as the
broker's models and as the parsers' records), on many seeded synthetic clusters and on hand-made
corner cases.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import msgspec
import numpy as np
import pytest
from pydantic import BaseModel

from tests.placement_support.synthetic import synthetic_inputs
from xhpc.models import GpuProbe, GpuProcess, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement import (
    HOLDING_STATES,
    ClusterSnapshot,
    GpuView,
    NodeView,
    SnapshotArrays,
    SnapshotView,
    arrays_for,
    build_snapshot,
    expand_hostlist,
)
from xhpc.slurm.parse import (
    parse_gres,
    parse_squeue_json,
)

Output = Callable[[str], str]
NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)


# -- the reference: build_snapshot before it was made fast ----------------------------------------
def _ref_job_gpus(jobs: Sequence[JobInfo]) -> dict[str, dict[int, list[str]]]:
    held: dict[str, dict[int, list[str]]] = {}
    for job in jobs:
        if job.state.upper() not in HOLDING_STATES or not job.gres_detail:
            continue
        hosts = expand_hostlist(job.nodes) or ((job.batch_host,) if job.batch_host else ())
        if len(hosts) == len(job.gres_detail):
            pairs = [(h, parse_gres(d)[2]) for h, d in zip(hosts, job.gres_detail, strict=True)]
        elif len(hosts) == 1:
            pairs = [(hosts[0], job.gpus_idx)]
        else:
            continue
        for host, indexes in pairs:
            per_gpu = held.setdefault(host, {})
            for index in indexes:
                per_gpu.setdefault(index, []).append(job.job_id)
    return held


def _ref_age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _ref_node_view(
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
    for index in range(total - 1, -1, -1):
        if missing == 0:
            break
        if index not in busy:
            unattributed.add(index)
            missing -= 1
    probe_age = _ref_age(now, probe.taken_at) if probe is not None else None
    stale = probe_age is not None and probe_age > probe_ttl_s
    seen = {g.index: g for g in probe.gpus} if probe is not None and not stale else {}
    gpus: list[GpuView] = []
    for index in range(total):
        jobs = tuple(held.get(index, ()))
        gpu = seen.get(index)
        if gpu is None:
            gpus.append(GpuView(index=index, slurm_jobs=jobs, unattributed=index in unattributed))
            continue
        foreign = any(
            p.job_id is None and (p.mem_used_mb is None or p.mem_used_mb > 0) for p in gpu.processes
        )
        gpus.append(
            GpuView(
                index=index,
                slurm_jobs=jobs,
                unattributed=index in unattributed,
                healthy=gpu.healthy,
                foreign=foreign,
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


def reference_build(
    nodes: Sequence[NodeInfo],
    jobs: Sequence[JobInfo],
    reservations: Sequence[Reservation] = (),
    probes: Mapping[str, ProbeReport] | None = None,
    *,
    now: datetime,
    probe_ttl_s: float = 30.0,
    sinfo_at: datetime | None = None,
    squeue_at: datetime | None = None,
) -> SnapshotView:
    held = _ref_job_gpus(jobs)
    reserved: dict[str, int] = {}
    for r in reservations:
        reserved[r.node] = reserved.get(r.node, 0) + max(0, r.gpus)
    probes = probes or {}
    views = [
        _ref_node_view(
            node,
            held.get(node.name, {}),
            reserved.get(node.name, 0),
            probes.get(node.name),
            now,
            probe_ttl_s,
        )
        for node in sorted({n.name: n for n in nodes}.values(), key=lambda n: n.name)
    ]
    return SnapshotView(
        taken_at=now,
        nodes=tuple(views),
        probe_ttl_s=probe_ttl_s,
        sinfo_age_s=_ref_age(now, sinfo_at),
        squeue_age_s=_ref_age(now, squeue_at),
    )


def _ref_load(node: NodeView) -> float:
    """NodeView.load as it was written before."""
    utils = [
        min(max(g.util_pct / 100.0, 0.0), 1.0)
        for g in node.gpus
        if g.util_pct is not None and math.isfinite(g.util_pct)
    ]
    mems = [
        min(max(g.mem_used_mb / g.mem_total_mb, 0.0), 1.0)
        for g in node.gpus
        if g.mem_used_mb is not None
        and g.mem_total_mb is not None
        and math.isfinite(g.mem_used_mb)
        and math.isfinite(g.mem_total_mb)
        and g.mem_total_mb > 0
    ]
    parts = [sum(values) / len(values) for values in (utils, mems) if values]
    return sum(parts) / len(parts) if parts else 0.0


# -- comparing ------------------------------------------------------------------------------------
def _assert_same_model(got: BaseModel, want: BaseModel, where: str) -> None:
    assert type(got) is type(want), where
    assert got.model_fields_set == want.model_fields_set, where
    assert list(got.__dict__) == list(want.__dict__), where
    for key, value in want.__dict__.items():
        mine = got.__dict__[key]
        if isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
            assert len(mine) == len(value), f"{where}.{key}"
            for i, (g, w) in enumerate(zip(mine, value, strict=True)):
                _assert_same_model(g, w, f"{where}.{key}[{i}]")
        else:
            assert type(mine) is type(value), f"{where}.{key}"
            assert repr(mine) == repr(value), f"{where}.{key}"  # NaN and -0.0 included


def assert_same_snapshot(got: ClusterSnapshot, want: SnapshotView) -> None:
    assert got.view().model_dump_json() == want.model_dump_json()
    _assert_same_model(got.view(), want, "snapshot")
    # the arrays build_snapshot computed without views: the views' properties, and what a build
    # from the reference's views gives
    arrays, fresh = arrays_for(got), SnapshotArrays.from_views(want.nodes)
    nodes = want.nodes
    assert arrays.names == tuple(n.name for n in nodes) == fresh.names
    assert dict(arrays.index) == {n.name: i for i, n in enumerate(nodes)}
    assert arrays.free.tolist() == [n.free for n in nodes] == fresh.free.tolist()
    assert arrays.usable.tolist() == [n.usable for n in nodes] == fresh.usable.tolist()
    assert arrays.tainted.tolist() == [n.tainted for n in nodes] == fresh.tainted.tolist()
    loads = [_ref_load(n) for n in nodes]
    assert [n.load for n in got.nodes] == loads
    assert arrays.load.tolist() == loads == fresh.load.tolist()
    for name in ("name_rank", "idle_rank"):
        assert np.array_equal(getattr(arrays, name), getattr(fresh, name)), name
    for name in ("partitions", "gpu_types"):
        mine, theirs = getattr(arrays, name), getattr(fresh, name)
        assert set(mine) == set(theirs), name
        assert all(np.array_equal(mine[k], theirs[k]) for k in theirs), name
    assert arrays.max_gpus == fresh.max_gpus
    for array in (arrays.free, arrays.usable, arrays.tainted, arrays.load, arrays.idle_rank):
        assert not array.flags.writeable


def both(*args: object, **kwargs: object) -> ClusterSnapshot:
    got = build_snapshot(*args, **kwargs)  # type: ignore[arg-type]
    assert_same_snapshot(got, reference_build(*args, **kwargs))  # type: ignore[arg-type]
    return got


# -- cases ----------------------------------------------------------------------------------------
def test_captured_slurm_output(
    busy_nodes: list[NodeInfo], idle_nodes: list[NodeInfo], slurm_output: Output
) -> None:
    jobs = parse_squeue_json(slurm_output("squeue-mixed.json"))
    res = [Reservation(replica_id="a", node="n2", gpus=1, created_at=NOW)]
    for nodes in (busy_nodes, idle_nodes):
        for some_jobs in (jobs, [], jobs[:3]):
            both(nodes, some_jobs, res, now=NOW, sinfo_at=NOW - timedelta(seconds=3))


@pytest.mark.parametrize("seed", range(60))
def test_seeded_synthetic_clusters(seed: int) -> None:
    rng = random.Random(seed)
    inputs = synthetic_inputs(
        rng.randint(0, 40),
        rng.choice(((8,), (4,), (1, 2, 4, 8), (0, 2, 16))),
        seed=seed,
        now=NOW,
        busy=rng.choice((0.0, 0.3, 0.5, 0.9)),
        probe_ttl_s=rng.choice((30.0, 5.0)),
    )
    both(
        inputs.nodes,
        inputs.jobs,
        inputs.reservations,
        inputs.probes,
        now=NOW,
        probe_ttl_s=inputs.probe_ttl_s,
        squeue_at=NOW,
    )


def _node(name: str, total: int = 4, **kw: object) -> NodeInfo:
    fields: dict[str, object] = {"name": name, "address": name, "state": "MIXED"}
    return NodeInfo.model_validate(fields | {"gpus_total": total} | kw)


def _job(job_id: str, nodes: str | None, *details: str, **kw: object) -> JobInfo:
    idx = tuple(i for d in details for i in parse_gres(d)[2])
    fields: dict[str, object] = {"job_id": job_id, "raw_job_id": 1, "name": "j", "state": "RUNNING"}
    return msgspec.convert(
        fields | {"nodes": nodes, "gres_detail": details, "gpus_idx": idx} | kw, JobInfo
    )


def _probe(node: str, *gpus: GpuProbe, age_s: float = 1.0) -> ProbeReport:
    return ProbeReport(
        node=node, taken_at=NOW - timedelta(seconds=age_s), backend="fake", gpus=gpus
    )


def test_corner_cases() -> None:
    nodes = [
        _node("b", gpus_used=3),  # unexplained use: highest free indexes
        _node("a", gpus_used=2, gpus_used_idx=(1, 7, -1)),  # IDX from sinfo, some out of range
        _node("c", 2, gpus_used=1, state_flags=("drain",)),
        _node("d", 8, gpus_used=9),  # more used than GPUs
        _node("e", 0),
        _node("f", 4, state="IDLE"),  # duplicate name: the last one wins
        _node("f", 4, state="DOWN", reason="gone", partitions=("x", "y"), gpu_type="h100"),
        _node("g", 4, gpus_used=1),
        _node("none", 2),
        _node("h", 4, gpus_used=2),
        _node("i", 4, state="IDLE"),
    ]
    jobs = [
        _job("1", "b", "gpu:1(IDX:0)"),
        _job("2", "b", "gpu:2(IDX:0,1)"),  # shares GPU 0 with job 1
        _job("3", "b", "gpu:1(IDX:9)"),  # an index the node does not have
        _job("4", "c", "gpu:1(IDX:1)", state="completing"),
        _job("5", "c", "gpu:1(IDX:0)", state="PENDING"),
        _job("6", "n[1-3]", "gpu:1(IDX:0)", "gpu:1(IDX:0)"),  # cannot align: skipped
        _job("7", "d,e", "gpu:2(IDX:6-7)", "gpu:1(IDX:0)"),
        _job("8", None, "gpu:1(IDX:3)", batch_host="g"),
        _job("9", "(null)", "gpu:1(IDX:2)", "gpu:1(IDX:1)", batch_host="g"),  # one host: gpus_idx
        _job("10", "none", "gpu:1(IDX:1)", batch_host="h"),  # "none" is no node
        _job("11", "", "gpu:1(IDX:0)", "gpu:1(IDX:1)", batch_host="h", gpus_idx=(-1, 5)),
        _job("12", "g", "gpu:1(IDX:3)", state="SUSPENDED"),
        _job("13", "zz", "gpu:1(IDX:0)"),  # a node sinfo does not list
    ]
    nan, inf = float("nan"), float("inf")
    foreign = (GpuProcess(pid=1, mem_used_mb=10.0),)
    probes = {
        "b": _probe(
            "b",
            GpuProbe(index=0, util_pct=50.0, mem_used_mb=1.0, mem_total_mb=2.0),
            GpuProbe(index=1, util_pct=nan, mem_used_mb=inf, mem_total_mb=2.0),
            GpuProbe(index=2, util_pct=-0.0, mem_used_mb=0.0, mem_total_mb=0.0),
            GpuProbe(index=3, util_pct=0.0, mem_used_mb=-0.0, mem_total_mb=10.0),
            GpuProbe(index=3, util_pct=250.0, mem_used_mb=-5.0, mem_total_mb=10.0),  # dup index
            GpuProbe(index=7, util_pct=10.0),  # beyond the node's GPUs
        ),
        "a": _probe(
            "a",
            GpuProbe(index=0, healthy=False, error="GPU is lost"),
            GpuProbe(index=1, processes=foreign, util_pct=0.0),
            GpuProbe(index=2, processes=(GpuProcess(pid=2, job_id="5"),), util_pct=0.0),
            GpuProbe(index=3, processes=(GpuProcess(pid=3, mem_used_mb=0.0),)),
        ),
        "c": _probe("c", GpuProbe(index=0, util_pct=-0.0), GpuProbe(index=1, util_pct=0.0)),
        "d": _probe("d", GpuProbe(index=0, healthy=False), age_s=31.0),  # stale
        "g": _probe("g"),  # fresh, lists no GPU
        "h": _probe("h", *(GpuProbe(index=i, util_pct=0.0) for i in range(4))),
        "i": _probe("i", *(GpuProbe(index=i, util_pct=0.0) for i in range(4)), age_s=2.0),
        "zz": _probe("zz", GpuProbe(index=0)),
    }
    reservations = [
        Reservation(replica_id="r1", node="b", gpus=1, created_at=NOW),
        Reservation(replica_id="r2", node="b", gpus=-3, created_at=NOW),
        Reservation(replica_id="r3", node="h", gpus=9, created_at=NOW),
        Reservation(replica_id="r4", node="zz", gpus=1, created_at=NOW),
    ]
    snap = both(nodes, jobs, reservations, probes, now=NOW, probe_ttl_s=30.0)
    by_name = {n.name: n for n in snap.nodes}
    assert by_name["f"].state == "DOWN"
    # GPUs that read the same share one view; zeros keep their sign
    c0, c1 = by_name["c"].gpus
    assert (repr(c0.util_pct), repr(c1.util_pct)) == ("-0.0", "0.0")
    h, i = by_name["h"].gpus, by_name["i"].gpus
    assert h[1].slurm_jobs == ("10",) and h[3].unattributed
    assert h[0] is i[0] and h[2] is i[2] and h[1] is not i[1] and h[3] is not i[3]
    # an int probe_ttl_s is validated into a float, as it always was
    both(nodes, jobs, reservations, probes, now=NOW, probe_ttl_s=30)
    both(nodes, jobs, reservations, probes, now=NOW, probe_ttl_s=0.5)
    both([], [], now=NOW)


def test_idle_gpus_are_one_shared_frozen_view() -> None:
    nodes = [_node("a", 8), _node("b", 8)]
    first = build_snapshot(nodes, [], now=NOW)
    assert first.nodes[0].gpus == first.nodes[1].gpus
    assert all(a is b for a, b in zip(first.nodes[0].gpus, first.nodes[1].gpus, strict=True))
    gpu = first.nodes[0].gpus[3]
    with pytest.raises(ValueError):
        gpu.index = 5  # type: ignore[misc]
    changed = gpu.model_copy(update={"unattributed": True})
    assert changed.unattributed and not gpu.unattributed
    assert gpu.model_fields_set == {"index", "slurm_jobs", "unattributed"}
    assert build_snapshot(nodes, [], now=NOW).nodes[1].gpus[3] == GpuView(index=3)


def test_build_errors() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        build_snapshot([_node("a")], [], now=datetime(2026, 1, 1))
    with pytest.raises(TypeError):  # a naive probe time
        build_snapshot(
            [_node("a")],
            [],
            probes={"a": _probe("a").model_copy(update={"taken_at": datetime(2026, 1, 1)})},
            now=NOW,
        )
