"""Lazy node views: a snapshot keeps its column arrays and builds its views when they are read.

build_snapshot computes the placement arrays only; the views come from the same inputs when
something reads them (``snapshot.nodes``, ``snapshot.node(name)``, ``snapshot.view()``), and are
then what an eager, validated build gives. A decision must build none.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from tests.placement_support.reference import reference_place
from tests.placement_support.synthetic import SyntheticInputs, synthetic_inputs
from xhpc.models import GpuProbe, GpuProcess, ProbeReport, Reservation
from xhpc.placement import (
    ClusterSnapshot,
    PlacementError,
    PlacementRequest,
    SnapshotArrays,
    SnapshotView,
    apply_reservations,
    arrays_for,
    build_snapshot,
    get_strategy,
)

NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)


def inputs_of(seed: int, n_nodes: int = 30) -> SyntheticInputs:
    return synthetic_inputs(n_nodes, (2, 4, 8), seed=seed, now=NOW, busy=0.5)


def fresh(inputs: SyntheticInputs) -> ClusterSnapshot:
    return build_snapshot(
        inputs.nodes,
        inputs.jobs,
        inputs.reservations,
        inputs.probes,
        now=NOW,
        probe_ttl_s=inputs.probe_ttl_s,
    )


def built(snap: ClusterSnapshot) -> int:
    """How many node views the snapshot has built so far."""
    return sum(v is not None for v in snap._sources.views)


def eager(snap: ClusterSnapshot) -> SnapshotView:
    """The same snapshot's views, validated again from their dump."""
    return SnapshotView.model_validate(snap.view().model_dump())


def test_a_decision_builds_no_view() -> None:
    inputs = inputs_of(2, 200)
    snap = fresh(inputs)
    strategy = get_strategy("idle-first")
    strategy.place(snap, PlacementRequest(gpus=1, replicas=3))
    strategy.place(snap, PlacementRequest(gpus=1, partition="gpu", gpu_type="a100"))
    assert built(snap) == 0 and "nodes" not in vars(snap)


def test_node_builds_only_that_view_and_nodes_keeps_it() -> None:
    inputs = inputs_of(3)
    snap, want = fresh(inputs), eager(fresh(inputs))
    name = inputs.nodes[7].name
    view = snap.node(name)
    assert snap.node("nope") is None and built(snap) == 1
    assert view == want.node(name)
    assert snap.node(name) is view
    assert snap.nodes[snap.arrays.index[name]] is view  # the one view, built once
    assert snap.nodes is snap.nodes and built(snap) == len(inputs.nodes)
    assert snap.view() == want and snap.view().model_dump_json() == want.model_dump_json()


def test_a_failed_decision_names_the_same_problems() -> None:
    inputs = inputs_of(4)
    snap, want = fresh(inputs), eager(fresh(inputs))
    request = PlacementRequest(gpus=8, replicas=40, partition="gpu")
    with pytest.raises(PlacementError) as got:
        get_strategy("pack").place(snap, request)
    with pytest.raises(PlacementError) as ref:
        reference_place(want, request, "pack")
    assert got.value.problems == ref.value.problems


def test_apply_reservations_builds_only_the_reserved_nodes_views() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        inputs = inputs_of(seed, rng.randint(1, 25))
        snap = fresh(inputs)
        names = [n.name for n in inputs.nodes] + ["not-a-node"]
        new = [
            Reservation(
                replica_id=f"x{i}", node=rng.choice(names), gpus=rng.randint(1, 3), created_at=NOW
            )
            for i in range(rng.randint(1, 4))
        ]
        child = apply_reservations(snap, new)
        grandchild = apply_reservations(child, new[:1])
        assert built(snap) == 0
        assert built(child) <= len({r.node for r in new})
        for got, extra in ((child, new), (grandchild, [*new, *new[:1]])):
            rebuilt = build_snapshot(
                inputs.nodes, inputs.jobs, (*inputs.reservations, *extra), inputs.probes, now=NOW
            )
            assert got.view() == rebuilt.view()
            derived, again = arrays_for(got), SnapshotArrays.from_views(got.nodes)
            for field in ("free", "usable", "tainted", "load", "name_rank", "idle_rank"):
                assert np.array_equal(getattr(derived, field), getattr(again, field)), field
        assert snap.view() == fresh(inputs).view()  # the parent is unchanged


def _report(node: str, age_s: float, *gpus: GpuProbe) -> ProbeReport:
    return ProbeReport(
        node=node, taken_at=NOW - timedelta(seconds=age_s), backend="fake", gpus=gpus
    )


def test_probe_reports_give_the_views_values() -> None:
    """The arrays' reading of a report (fresh, replaced, stale, a node whose GPU count changed)
    is the views' reading."""
    inputs = inputs_of(5, 12)
    nodes = list(inputs.nodes)
    a, b, c = (n.name for n in nodes[:3])
    lost = GpuProbe(index=1, healthy=False, error="GPU is lost")
    foreign = GpuProbe(index=0, processes=(GpuProcess(pid=1, mem_used_mb=5.0),), util_pct=40.0)
    first = {
        a: _report(a, 1.0, GpuProbe(index=0, util_pct=90.0), lost),
        b: _report(b, 29.0, foreign),
        c: _report(c, 1.0, *(GpuProbe(index=i, util_pct=10.0 * i) for i in (3, 0, 3, 9))),
    }
    later = {**first, a: _report(a, 2.0, GpuProbe(index=0, util_pct=10.0))}
    grown = nodes[2].model_copy(update={"gpus_total": nodes[2].gpus_total + 4})
    steps = [
        (nodes, first, NOW),
        (nodes, later, NOW),
        (nodes, later, NOW + timedelta(seconds=2)),  # b's report goes stale
        ([*nodes[:2], grown, *nodes[3:]], later, NOW),
    ]
    for step_nodes, probes, now in steps:
        snap = build_snapshot(step_nodes, inputs.jobs, (), probes, now=now)
        arrays, views = arrays_for(snap), SnapshotArrays.from_views(eager(snap).nodes)
        for field in ("free", "usable", "tainted", "load", "idle_rank"):
            assert np.array_equal(getattr(arrays, field), getattr(views, field)), field
        assert arrays.tainted[1] == (now == NOW)  # b's foreign memory, while its report is fresh
