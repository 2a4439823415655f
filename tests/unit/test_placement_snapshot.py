"""ClusterSnapshot from real captured sinfo/squeue output, reservations and probe reports."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from xhpc.models import GpuProbe, GpuProcess, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement import NodeView, SnapshotView, build_snapshot
from xhpc.placement.snapshot import apply_reservations
from xhpc.slurm.parse import parse_squeue_json

Output = Callable[[str], str]
NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)


def used(node: NodeView) -> dict[int, tuple[str, ...]]:
    return {g.index: g.slurm_jobs for g in node.gpus if g.allocated}


def probe(node: str, *gpus: GpuProbe, age_s: float = 1.0) -> ProbeReport:
    return ProbeReport(
        node=node, taken_at=NOW - timedelta(seconds=age_s), backend="fake", gpus=gpus
    )


def gpu(index: int, **kw: object) -> GpuProbe:
    fields: dict[str, object] = {"mem_total_mb": 1000.0, "mem_used_mb": 0.0, "util_pct": 0.0}
    fields.update(kw)
    return GpuProbe.model_validate({"index": index, **fields})


# -- Slurm view from the real captures -------------------------------------------------------------
def test_busy_cluster_per_gpu_use_from_squeue(
    busy_nodes: list[NodeInfo], slurm_output: Output
) -> None:
    jobs = parse_squeue_json(slurm_output("squeue-mixed.json"))
    snap = build_snapshot(busy_nodes, jobs, now=NOW)
    n1, n2, n3 = snap.nodes
    # plain jobs 1 (2 GPUs) and 2, array task 5_0 on n1; the throttled array 7_0 holds no GPU
    assert used(n1) == {0: ("1",), 1: ("1",), 2: ("2",), 3: ("5_0",)}
    # het component 3+0 and array tasks 5_1, 5_2 on n2
    assert used(n2) == {0: ("3+0",), 1: ("5_1",), 2: ("5_2",)}
    # het component 3+1 keeps running on the draining n3
    assert used(n3) == {0: ("3+1",)}
    assert [(n.name, n.free, n.allocated, n.usable) for n in snap.nodes] == [
        ("n1", 0, 4, True),
        ("n2", 1, 3, True),
        ("n3", 3, 1, False),
    ]
    assert n3.state_flags == ("DRAIN",) and n3.reason == "test"
    assert not any(g.unattributed for n in snap.nodes for g in n.gpus)
    assert n1.address == "10.77.0.11" and n1.partitions == ("gpu",)


def test_pending_jobs_hold_nothing(idle_nodes: list[NodeInfo], slurm_output: Output) -> None:
    jobs = [j for j in parse_squeue_json(slurm_output("squeue-mixed.json")) if j.state == "PENDING"]
    assert jobs
    snap = build_snapshot(idle_nodes, jobs, now=NOW)
    assert [n.free for n in snap.nodes] == [4, 4, 4]


def test_unexplained_sinfo_use_takes_the_highest_indexes(busy_nodes: list[NodeInfo]) -> None:
    # squeue not yet showing the jobs sinfo already counts: Slurm says how many, not which
    snap = build_snapshot(busy_nodes, [], now=NOW)
    assert [[g.index for g in n.gpus if g.unattributed] for n in snap.nodes] == [
        [0, 1, 2, 3],
        [1, 2, 3],
        [3],
    ]
    assert [n.free for n in snap.nodes] == [0, 1, 3]


def test_partly_explained_use(busy_nodes: list[NodeInfo], slurm_output: Output) -> None:
    jobs = [j for j in parse_squeue_json(slurm_output("squeue-mixed.json")) if j.job_id == "5_1"]
    snap = build_snapshot(busy_nodes, jobs, now=NOW)
    n2 = snap.nodes[1]  # sinfo: 3 used; squeue explains index 1 only
    assert used(n2) == {1: ("5_1",), 2: (), 3: ()}
    assert n2.free == 1 and n2.gpus[0].idle


def test_squeue_newer_than_sinfo_keeps_every_index_busy(idle_nodes: list[NodeInfo]) -> None:
    job = JobInfo(
        job_id="9", raw_job_id=9, name="j", state="RUNNING", nodes="n1",
        gres_detail=("gpu:2(IDX:1-2)",), gpus_idx=(1, 2),
    )  # fmt: skip
    snap = build_snapshot(idle_nodes, [job], now=NOW)
    assert used(snap.nodes[0]) == {1: ("9",), 2: ("9",)} and snap.nodes[0].free == 2


def test_multi_node_job_details_align_with_its_hostlist(idle_nodes: list[NodeInfo]) -> None:
    job = JobInfo(
        job_id="7", raw_job_id=7, name="j", state="COMPLETING", nodes="n[1-2]",
        gres_detail=("gpu:2(IDX:0-1)", "gpu:1(IDX:3)"), gpus_idx=(0, 1, 3),
    )  # fmt: skip
    snap = build_snapshot(idle_nodes, [job], now=NOW)
    assert used(snap.nodes[0]) == {0: ("7",), 1: ("7",)}
    assert used(snap.nodes[1]) == {3: ("7",)}
    assert used(snap.nodes[2]) == {}


def test_details_that_do_not_align_are_left_to_sinfo_counts(idle_nodes: list[NodeInfo]) -> None:
    job = JobInfo(
        job_id="7", raw_job_id=7, name="j", state="RUNNING", nodes="n[1-3]",
        gres_detail=("gpu:1(IDX:0)", "gpu:1(IDX:0)"),
    )  # fmt: skip
    snap = build_snapshot(idle_nodes, [job], now=NOW)
    assert all(n.allocated == 0 for n in snap.nodes)


def test_reservations_are_counts_that_lower_free(idle_nodes: list[NodeInfo]) -> None:
    res = [
        Reservation(replica_id="a", node="n1", gpus=3, created_at=NOW),
        Reservation(replica_id="b", node="n2", gpus=2, created_at=NOW),
        Reservation(replica_id="c", node="n2", gpus=9, created_at=NOW),
        Reservation(replica_id="d", node="gone", gpus=1, created_at=NOW),
    ]
    snap = build_snapshot(idle_nodes, [], res, now=NOW)
    assert [(n.reserved, n.free) for n in snap.nodes] == [(3, 1), (11, 0), (0, 4)]


def test_nodes_are_sorted_and_names_unique(idle_nodes: list[NodeInfo]) -> None:
    snap = build_snapshot(list(reversed(idle_nodes)), [], now=NOW)
    assert [n.name for n in snap.nodes] == ["n1", "n2", "n3"]
    assert snap.node("n2") is snap.nodes[1] and snap.node("nope") is None
    with pytest.raises(ValueError, match="duplicate node names"):
        SnapshotView(taken_at=NOW, nodes=(snap.nodes[0], snap.nodes[0]))


def test_now_must_be_timezone_aware(idle_nodes: list[NodeInfo]) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        build_snapshot(idle_nodes, [], now=datetime(2026, 1, 1))


def test_source_ages(idle_nodes: list[NodeInfo]) -> None:
    snap = build_snapshot(
        idle_nodes, [], now=NOW, sinfo_at=NOW - timedelta(seconds=2), squeue_at=NOW
    )
    assert (snap.sinfo_age_s, snap.squeue_age_s) == (2.0, 0.0)


# -- probes ----------------------------------------------------------------------------------------
def test_fresh_probe_lost_gpu_and_foreign_memory_are_not_free(idle_nodes: list[NodeInfo]) -> None:
    probes = {
        "n1": probe("n1", gpu(0, healthy=False, error="GPU is lost", util_pct=None), gpu(1)),
        "n2": probe("n2", gpu(2, processes=(GpuProcess(pid=7, mem_used_mb=500.0),))),
        "n3": probe("n3", gpu(0, processes=(GpuProcess(pid=8, mem_used_mb=500.0, job_id="3"),))),
    }
    snap = build_snapshot(idle_nodes, [], probes=probes, now=NOW)
    n1, n2, n3 = snap.nodes
    assert (n1.free, n1.unhealthy, n1.tainted, n1.gpus[0].error) == (3, 1, True, "GPU is lost")
    assert (n2.free, n2.foreign, n2.tainted, n2.gpus[2].foreign) == (3, 1, True, True)
    assert (n3.free, n3.foreign, n3.tainted) == (4, 0, False)  # the process belongs to a job
    assert all(n.probe_fresh and n.probe_age_s == 1.0 for n in snap.nodes)


def test_stale_probe_stops_influencing_and_says_so(idle_nodes: list[NodeInfo]) -> None:
    report = probe("n1", gpu(0, healthy=False), gpu(1, util_pct=90.0), age_s=31.0)
    snap = build_snapshot(idle_nodes, [], probes={"n1": report}, now=NOW, probe_ttl_s=30.0)
    n1 = snap.nodes[0]
    assert n1.probe_stale and not n1.probe_fresh and n1.probe_age_s == 31.0
    assert (n1.free, n1.tainted, n1.load) == (4, False, 0.0)
    assert all(g.util_pct is None and g.healthy for g in n1.gpus)
    fresh = build_snapshot(idle_nodes, [], probes={"n1": report}, now=NOW, probe_ttl_s=60.0)
    assert (fresh.nodes[0].free, fresh.nodes[0].tainted) == (3, True)
    assert not snap.nodes[1].probe_stale and snap.nodes[1].probe_age_s is None


def test_load_is_mean_of_util_and_memory_fractions(idle_nodes: list[NodeInfo]) -> None:
    report = probe(
        "n1",
        gpu(0, util_pct=50.0, mem_used_mb=500.0),
        gpu(1, util_pct=float("nan"), mem_used_mb=2000.0),  # NaN ignored, memory clamped to 1
        gpu(2, util_pct=None, mem_used_mb=None),
    )
    n1 = build_snapshot(idle_nodes, [], probes={"n1": report}, now=NOW).nodes[0]
    assert n1.load == pytest.approx((0.5 + (0.5 + 1.0) / 2) / 2)
    assert build_snapshot(idle_nodes, [], now=NOW).nodes[0].load == 0.0


def test_inputs_are_not_mutated(busy_nodes: list[NodeInfo], slurm_output: Output) -> None:
    jobs = parse_squeue_json(slurm_output("squeue-mixed.json"))
    res = [Reservation(replica_id="a", node="n2", gpus=1, created_at=NOW)]
    probes = {"n1": probe("n1", gpu(0, healthy=False))}
    before = [m.model_dump() for m in (*busy_nodes, *res, *probes.values())]
    jobs_before = [msgspec.structs.asdict(j) for j in jobs]
    build_snapshot(busy_nodes, jobs, res, probes, now=NOW)
    assert [m.model_dump() for m in (*busy_nodes, *res, *probes.values())] == before
    assert [msgspec.structs.asdict(j) for j in jobs] == jobs_before


def test_a_reservation_across_nodes_lowers_free_on_every_node_of_its_set(
    idle_nodes: list[NodeInfo],
) -> None:
    res = [Reservation(replica_id="a", node="n1", gpus=3, created_at=NOW, also=("n3",))]
    snap = build_snapshot(idle_nodes, [], res, now=NOW)
    assert [(n.reserved, n.free) for n in snap.nodes] == [(3, 1), (0, 4), (3, 1)]
    added = apply_reservations(build_snapshot(idle_nodes, [], now=NOW), res)
    assert [n.free for n in added.nodes] == [1, 4, 1]
