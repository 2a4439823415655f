"""Replicas that span nodes: node sets by idle-first and pack, topology, failures, invariants."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xhpc.models import NodeInfo, Reservation
from xhpc.placement import (
    ClusterSnapshot,
    Placement,
    PlacementError,
    PlacementRequest,
    Topology,
    build_snapshot,
    get_strategy,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def cluster(*sizes: int) -> list[NodeInfo]:
    return [
        NodeInfo.model_validate(
            {
                "name": f"n{i + 1}",
                "address": f"n{i + 1}",
                "state": "IDLE",
                "partitions": ("gpu",),
                "gpus_total": k,
            }
        )
        for i, k in enumerate(sizes)
    ]


def busy(node: str, gpus: int, rid: str = "other") -> Reservation:
    """``gpus`` of ``node`` taken (a reservation of the ledger: as good as a running job)."""
    return Reservation(replica_id=f"{rid}-{node}", node=node, gpus=gpus, created_at=NOW)


def snap(nodes: list[NodeInfo], *taken: Reservation) -> ClusterSnapshot:
    return build_snapshot(nodes, [], list(taken), None, now=NOW)


def sets(placements: list[Placement]) -> list[tuple[str, ...]]:
    return [p.nodes for p in placements]


def test_two_2_node_replicas_over_four_idle_nodes_take_disjoint_pairs() -> None:
    got = get_strategy("idle-first").place(
        snap(cluster(4, 4, 4, 4)), PlacementRequest(gpus=4, span=2, replicas=2)
    )
    assert sets(got) == [("n1", "n2"), ("n3", "n4")]
    assert got[0].node == "n1" and got[0].gpus == 4 and "n1+n2: idle" in got[0].reason


def test_whole_idle_nodes_come_before_partly_used_ones() -> None:
    got = get_strategy("idle-first").place(
        snap(cluster(4, 4, 4, 4), busy("n1", 2), busy("n3", 1)), PlacementRequest(gpus=2, span=2)
    )
    assert sets(got) == [("n2", "n4")]


def test_whole_nodes_only_when_the_job_takes_them_whole() -> None:
    """An --exclusive job: a node with one GPU in use is no candidate, and a chosen node is
    taken whole (the next replica goes elsewhere though GPUs there looked free)."""
    idle = snap(cluster(4, 4, 4, 4, 4), busy("n1", 1))
    req = PlacementRequest(gpus=1, span=2, replicas=2, whole=True)
    for name in ("idle-first", "pack"):
        got = get_strategy(name).place(idle, req)
        assert all("n1" not in s for s in sets(got)), (name, sets(got))
        assert len({n for s in sets(got) for n in s}) == 4, (name, sets(got))
    with pytest.raises(PlacementError):
        get_strategy("idle-first").place(idle, req.model_copy(update={"replicas": 3}))
    # without it, the partly used node is a candidate as any other
    partly = get_strategy("pack").place(idle, req.model_copy(update={"whole": False}))
    assert "n1" in {n for s in sets(partly) for n in s}


def test_pack_takes_the_fullest_nodes_that_still_fit() -> None:
    got = get_strategy("pack").place(
        snap(cluster(4, 4, 4, 4), busy("n1", 2), busy("n3", 2)), PlacementRequest(gpus=2, span=2)
    )
    assert sets(got) == [("n1", "n3")]


def test_among_equally_idle_sets_the_one_holding_the_weights_wins() -> None:
    request = PlacementRequest(gpus=1, span=2, model="big", local_nodes=frozenset({"n3", "n4"}))
    (got,) = get_strategy("idle-first").place(snap(cluster(2, 2, 2, 2)), request)
    assert got.nodes == ("n3", "n4") and "2 of 2 hold big locally" in got.reason


def test_a_set_stays_within_one_leaf_switch_when_one_has_room() -> None:
    topo = Topology(leaves={"s1": ("n1", "n2", "n3"), "s2": ("n4", "n5", "n6")})
    nodes = cluster(4, 4, 4, 4, 4, 4)
    # Without a topology the three idlest nodes are n2, n3, n4: across both switches.
    taken = snap(nodes, busy("n1", 1), busy("n5", 2), busy("n6", 2))
    (flat,) = get_strategy("idle-first").place(taken, PlacementRequest(gpus=2, span=3))
    assert flat.nodes == ("n2", "n3", "n4")
    (tree,) = get_strategy("idle-first").place(taken, PlacementRequest(gpus=2, span=3), topo)
    assert tree.nodes == ("n2", "n3", "n1") and "on switch s1" in tree.reason


def test_a_set_spans_switches_only_when_no_leaf_has_enough_nodes() -> None:
    topo = Topology(leaves={"s1": ("n1", "n2"), "s2": ("n3", "n4")})
    (got,) = get_strategy("idle-first").place(
        snap(cluster(4, 4, 4, 4)), PlacementRequest(gpus=1, span=3), topo
    )
    assert got.nodes == ("n1", "n2", "n3") and "across 2 switches" in got.reason


def test_a_set_that_does_not_fit_places_nothing_and_says_why() -> None:
    with pytest.raises(PlacementError) as err:
        get_strategy("idle-first").place(
            snap(cluster(4, 4, 4), busy("n2", 3)), PlacementRequest(gpus=3, span=2, replicas=2)
        )
    text = str(err.value)
    assert err.value.fitted == 1 and "only 1 of 2 replicas (2 nodes x 3 GPUs) fit" in text
    assert "a replica needs 2" in text


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    used=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    gpus=st.integers(1, 4),
    span=st.integers(2, 4),
    replicas=st.integers(1, 3),
    name=st.sampled_from(("idle-first", "pack")),
)
def test_sets_never_overallocate_and_each_is_the_best_by_brute_force(
    sizes: list[int], used: list[int], gpus: int, span: int, replicas: int, name: str
) -> None:
    """Every replica's nodes are distinct, no node gives more GPUs than it has free, and each
    set is the best of all the sets possible at its turn (its members' ranks compared in
    order: a plain loop over every combination)."""
    nodes = cluster(*sizes)
    taken = [busy(n.name, min(u, n.gpus_total)) for n, u in zip(nodes, used, strict=False) if u]
    s = snap(nodes, *taken)
    request = PlacementRequest(gpus=gpus, span=span, replicas=replicas)
    free = {n.name: n.free for n in s.nodes}
    try:
        got = get_strategy(name).place(s, request)
    except PlacementError as err:
        got = []
        fitted = err.fitted
    else:
        fitted = replicas
    for i in range(fitted):
        fits = [n for n in sorted(free) if free[n] >= gpus]

        def rank(node: str, fits: list[str] = fits) -> tuple[int, str]:
            # No probes, no taint, no weights: idle-first = most free; pack = least free.
            return (-free[node] if name == "idle-first" else free[node], node)

        best = min(
            (sorted(c, key=rank) for c in itertools.combinations(fits, span)),
            key=lambda c: [rank(n) for n in c],
            default=None,
        )
        assert best is not None
        if got:
            assert list(got[i].nodes) == best and len(set(got[i].nodes)) == span
        for n in best:
            free[n] -= gpus
            assert free[n] >= 0
    if fitted < replicas:  # the next one had no set of `span` nodes with room
        assert sum(1 for n in free if free[n] >= gpus) < span


def test_the_dev_cluster_s_topology_is_read_as_its_leaf_switches() -> None:
    """`scontrol show topology` as the dev cluster prints it (captured): leaves only, their
    hostlists expanded; a cluster without a tree prints no switch."""
    from pathlib import Path

    from xhpc.slurm.partitions import parse_topology

    text = (Path(__file__).parents[1] / "data/slurm/scontrol-show-topology.txt").read_text()
    raw = parse_topology(text)
    assert raw == {"leaf1": "n[1-2]", "leaf2": "n3"}
    assert Topology.of(raw).leaves == {"leaf1": ("n1", "n2"), "leaf2": ("n3",)}
    assert parse_topology("") == {}
