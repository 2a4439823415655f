"""Placement strategies by distribution properties and typed failures."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from tests.placement_support.reference import reference_place
from xhpc.errors import AdmissionError, ConfigError, ValidationError
from xhpc.models import GpuProbe, GpuProcess, NodeInfo, ProbeReport, Reservation
from xhpc.placement import (
    ClusterSnapshot,
    IdleFirst,
    Pack,
    Placement,
    PlacementError,
    PlacementRequest,
    SnapshotArrays,
    Strategy,
    build_snapshot,
    get_strategy,
    strategy_names,
)
from xhpc.slurm.parse import parse_squeue_json

Output = Callable[[str], str]
NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)
STRATEGIES = ("idle-first", "pack")


def cluster(*sizes: int, names: tuple[str, ...] = (), **node: object) -> list[NodeInfo]:
    names = names or tuple(f"n{i + 1}" for i in range(len(sizes)))
    return [
        NodeInfo.model_validate(
            {"name": n, "address": n, "state": "IDLE", "partitions": ("gpu",), "gpus_total": k}
            | node
        )
        for n, k in zip(names, sizes, strict=True)
    ]


def snap_of(
    nodes: list[NodeInfo],
    *,
    reservations: Sequence[Reservation] = (),
    probes: Mapping[str, ProbeReport] | None = None,
) -> ClusterSnapshot:
    return build_snapshot(nodes, [], reservations, probes, now=NOW)


def place(name: str, snap: ClusterSnapshot, **req: object) -> list[Placement]:
    request = PlacementRequest.model_validate(req)
    got = get_strategy(name).place(snap, request)
    assert got == reference_place(snap, request, name)
    return got


def nodes_of(placements: list[Placement]) -> list[str]:
    return [p.node for p in placements]


def per_node(placements: list[Placement]) -> dict[str, int]:
    return dict(Counter(p.node for p in placements))


# -- IdleFirst: spread -----------------------------------------------------------------------------
def test_six_2gpu_replicas_over_three_idle_4gpu_nodes_land_2_2_2() -> None:
    got = place("idle-first", snap_of(cluster(4, 4, 4)), gpus=2, replicas=6)
    assert [p.replica for p in got] == list(range(6))
    assert nodes_of(got) == ["n1", "n2", "n3", "n1", "n2", "n3"]
    assert per_node(got) == {"n1": 2, "n2": 2, "n3": 2}  # 4 GPUs each: disjoint, nothing shared


def test_four_1gpu_picks_over_2x2_land_two_per_node() -> None:
    got = place("idle-first", snap_of(cluster(2, 2)), gpus=1, replicas=4)
    assert per_node(got) == {"n1": 2, "n2": 2}


def test_eight_picks_over_2x2_do_not_fit_and_nothing_is_placed() -> None:
    snap = snap_of(cluster(2, 2))
    request = PlacementRequest(gpus=1, replicas=8)
    for name in STRATEGIES:
        with pytest.raises(PlacementError) as err:
            get_strategy(name).place(snap, request)
        assert err.value.fitted == 4 and err.value.request == request
        assert err.value.problems[0] == "only 4 of 8 replicas (1 GPU each) fit"
        with pytest.raises(PlacementError) as ref:
            reference_place(snap, request, name)
        assert ref.value.problems == err.value.problems


def test_idle_first_prefers_the_node_with_most_free_gpus(
    idle_nodes: list[NodeInfo], slurm_output: Output
) -> None:
    jobs = [j for j in parse_squeue_json(slurm_output("squeue-mixed.json")) if j.job_id != "5_2"]
    nodes = [n.model_copy(update={"gpus_used": 2}) if n.name == "n2" else n for n in idle_nodes]
    snap = build_snapshot(nodes, jobs, now=NOW)  # n1 0 free, n2 2 free, n3 3 free
    assert [n.free for n in snap.nodes] == [0, 2, 3]
    assert nodes_of(place("idle-first", snap, gpus=1, replicas=3)) == ["n3", "n2", "n3"]
    assert nodes_of(place("pack", snap, gpus=1, replicas=3)) == ["n2", "n2", "n3"]


def test_fresh_probe_load_breaks_ties_and_stale_load_is_ignored() -> None:
    def report(node: str, util: float, age_s: float = 1.0) -> ProbeReport:
        gpus = tuple(GpuProbe(index=i, util_pct=util) for i in range(4))
        return ProbeReport(
            node=node, taken_at=NOW - timedelta(seconds=age_s), backend="fake", gpus=gpus
        )

    probes = {"n1": report("n1", 90.0), "n2": report("n2", 10.0), "n3": report("n3", 50.0)}
    snap = snap_of(cluster(4, 4, 4), probes=probes)
    assert nodes_of(place("idle-first", snap, gpus=1, replicas=3)) == ["n2", "n3", "n1"]
    probes["n1"] = report("n1", 90.0, age_s=120.0)  # stale: scored on Slurm data alone
    assert nodes_of(place("idle-first", snap_of(cluster(4, 4, 4), probes=probes), gpus=1)) == ["n1"]


@pytest.mark.parametrize("name", STRATEGIES)
def test_lost_gpu_or_foreign_memory_lowers_a_node(name: str) -> None:
    lost = GpuProbe(index=0, healthy=False, error="GPU is lost")
    foreign = GpuProbe(index=3, processes=(GpuProcess(pid=1, mem_used_mb=100.0),))
    probes = {
        "n1": ProbeReport(node="n1", taken_at=NOW, backend="fake", gpus=(lost,)),
        "n2": ProbeReport(node="n2", taken_at=NOW, backend="fake", gpus=(foreign,)),
    }
    snap = snap_of(cluster(4, 4, 4), probes=probes)
    assert [(n.free, n.tainted) for n in snap.nodes] == [(3, True), (3, True), (4, False)]
    # the clean node first, for both strategies; then the tainted ones, by their own rules
    assert nodes_of(place(name, snap, gpus=1, replicas=5))[:4] == ["n3"] * 4
    # four GPUs are only left on the clean node
    assert nodes_of(place(name, snap, gpus=4)) == ["n3"]
    with pytest.raises(PlacementError):
        get_strategy(name).place(snap, PlacementRequest(gpus=4, replicas=2))


# -- Pack: best fit --------------------------------------------------------------------------------
def test_pack_fills_one_node_before_the_next() -> None:
    snap = snap_of(cluster(4, 4, 4))
    assert nodes_of(place("pack", snap, gpus=1, replicas=5)) == ["n1"] * 4 + ["n2"]
    assert nodes_of(place("pack", snap, gpus=2, replicas=3)) == ["n1", "n1", "n2"]


def test_pack_takes_the_fewest_free_gpus_that_still_fit() -> None:
    res = [
        Reservation(replica_id="a", node="n1", gpus=3, created_at=NOW),
        Reservation(replica_id="b", node="n2", gpus=1, created_at=NOW),
    ]
    snap = snap_of(cluster(4, 4, 4), reservations=res)  # free 1 / 3 / 4
    assert nodes_of(place("pack", snap, gpus=1)) == ["n1"]
    assert nodes_of(place("pack", snap, gpus=2)) == ["n2"]
    assert nodes_of(place("pack", snap, gpus=4)) == ["n3"]
    assert nodes_of(place("idle-first", snap, gpus=1)) == ["n3"]


# -- determinism, filters, failures ----------------------------------------------------------------
@pytest.mark.parametrize("name", STRATEGIES)
def test_ties_go_by_name_whatever_the_input_order(name: str) -> None:
    nodes = cluster(4, 4, 4, names=("c", "a", "b"))
    assert nodes_of(place(name, snap_of(nodes), gpus=4)) == ["a"]
    assert nodes_of(place(name, snap_of(nodes), gpus=4, replicas=3)) == ["a", "b", "c"]
    # arrays of views in any order rank the names the same way
    built = snap_of(nodes).nodes
    shuffled = SnapshotArrays.from_views((built[2], built[0], built[1]))
    assert shuffled.names == ("c", "a", "b") and shuffled.name_rank.tolist() == [2, 0, 1]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_drained_node_is_never_chosen(
    name: str, busy_nodes: list[NodeInfo], slurm_output: Output
) -> None:
    snap = build_snapshot(busy_nodes, parse_squeue_json(slurm_output("squeue-mixed.json")), now=NOW)
    assert nodes_of(place(name, snap, gpus=1)) == ["n2"]  # n3 has 3 free GPUs but drains
    with pytest.raises(PlacementError) as err:
        get_strategy(name).place(snap, PlacementRequest(gpus=1, replicas=2))
    assert err.value.fitted == 1
    assert "1 node(s) not usable: n3 (MIXED+DRAIN: test)" in err.value.problems


def test_too_big_names_why_and_is_an_admission_error() -> None:
    snap = snap_of(cluster(4, 2))
    with pytest.raises(PlacementError) as err:
        IdleFirst().place(snap, PlacementRequest(gpus=8))
    e = err.value
    assert isinstance(e, AdmissionError) and isinstance(e, ValidationError) and e.exit_code == 2
    assert e.fitted == 0
    assert e.problems[0] == "replica 0 of 1 (8 GPUs each) does not fit"
    assert "2 node(s) have fewer than 8 healthy GPUs: n1, n2" in e.problems
    assert e.hint


def test_filters_partition_type_and_node_list() -> None:
    nodes = [
        *cluster(4, gpu_type="a100", names=("a1",)),
        *cluster(4, gpu_type="h100", names=("h1",)),
        *cluster(8, gpu_type="h100", partitions=("big",), names=("h2",)),
    ]
    snap = snap_of(nodes)
    assert nodes_of(place("idle-first", snap, gpu_type="h100")) == ["h2"]
    assert nodes_of(place("idle-first", snap, gpu_type="h100", partition="gpu")) == ["h1"]
    assert nodes_of(place("idle-first", snap, nodes=("a1", "gone"), replicas=2)) == ["a1", "a1"]
    got = place("idle-first", snap, gpus=2, gpu_type="a100")
    assert got[0].gres == "gpu:a100:2" and Placement(replica=0, node="x", gpus=3).gres == "gpu:3"
    with pytest.raises(PlacementError) as err:
        Pack().place(snap, PlacementRequest(partition="nope", nodes=("zz",)))
    assert "unknown node(s) zz" in err.value.problems
    assert any("partition 'nope'" in p for p in err.value.problems)
    with pytest.raises(PlacementError) as err:
        Pack().place(snap, PlacementRequest(gpu_type="v100"))
    assert any("GPU type 'v100' (types there: a100, h100)" in p for p in err.value.problems)


def test_empty_snapshot() -> None:
    with pytest.raises(PlacementError) as err:
        IdleFirst().place(build_snapshot([], [], now=NOW), PlacementRequest())
    assert "the snapshot has no nodes" in err.value.problems


def test_request_validation() -> None:
    with pytest.raises(ValueError):
        PlacementRequest(gpus=0)
    with pytest.raises(ValueError):
        PlacementRequest(replicas=0)


def test_registry() -> None:
    assert strategy_names() == ("idle-first", "pack")
    assert isinstance(get_strategy("idle-first"), IdleFirst)
    assert get_strategy("pack").name == "pack"
    strategy: Strategy = get_strategy("idle-first")
    assert strategy.name == "idle-first"
    with pytest.raises(ConfigError, match="valid: idle-first, pack"):
        get_strategy("round-robin")
    with pytest.raises(ConfigError):
        reference_place(snap_of(cluster(1)), PlacementRequest(), "round-robin")
