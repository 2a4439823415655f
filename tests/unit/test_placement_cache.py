"""Cache-aware placement: among nodes equally idle (or equally good fits) the one that holds
the model's weights locally wins, and the placement's reason says so; free GPUs still come
first. Every decision is checked against the brute-force reference."""

from __future__ import annotations

from tests.unit.test_placement_strategy import cluster, place, snap_of


def test_among_equally_idle_nodes_the_one_holding_the_weights_wins_and_says_so() -> None:
    snap = snap_of(cluster(4, 4, 4))
    (got,) = place("idle-first", snap, model="tiny-llama", local_nodes=frozenset({"n2"}))
    assert got.node == "n2"
    assert got.reason == "n2: idle, 4 GPU(s) free, holds tiny-llama locally"
    (plain,) = place("idle-first", snap)
    assert (plain.node, plain.reason) == ("n1", "n1: idle, 4 GPU(s) free")


def test_free_gpus_still_come_before_the_weights() -> None:
    snap = snap_of(cluster(4, 2, 4))
    got = place("idle-first", snap, model="m", local_nodes=frozenset({"n2"}), replicas=3)
    assert [p.node for p in got] == ["n1", "n3", "n1"]


def test_replicas_still_spread_starting_with_the_node_that_holds_the_weights() -> None:
    snap = snap_of(cluster(4, 4, 4))
    got = place("idle-first", snap, model="m", local_nodes=frozenset({"n3"}), replicas=3)
    assert [p.node for p in got] == ["n3", "n1", "n2"]
    assert [p.reason.endswith("holds m locally") for p in got] == [True, False, False]


def test_pack_prefers_the_weights_among_equally_good_fits() -> None:
    snap = snap_of(cluster(2, 2, 4))
    got = place("pack", snap, model="m", local_nodes=frozenset({"n2", "n3"}), replicas=2)
    assert [p.node for p in got] == ["n2", "n2"]
    assert got[0].reason == "n2: best fit, 2 GPU(s) free, holds m locally"


def test_unknown_or_unusable_holders_change_nothing() -> None:
    snap = snap_of(cluster(4, 4, names=("a", "b")))
    (got,) = place("idle-first", snap, model="m", local_nodes=frozenset({"gone"}))
    assert got.node == "a"
