"""Deferred node views: a fresh snapshot builds them when first read, and is then an ordinary model.

build_snapshot computes the placement arrays only; the views come from the same inputs when
something reads them (xhpc/placement/views.py). Every way of reading the fields must build them
first and give what an eagerly built, validated snapshot gives; a decision must build none.
"""

from __future__ import annotations

import copy
import pickle
import random
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from pydantic import BaseModel, TypeAdapter

from xhpc.models import GpuProbe, GpuProcess, ProbeReport, Reservation
from xhpc.placement import (
    ClusterSnapshot,
    PlacementError,
    PlacementRequest,
    SnapshotArrays,
    apply_reservations,
    arrays_for,
    build_snapshot,
    get_strategy,
    reference_place,
)
from xhpc.placement import snapshot as snapshot_module
from xhpc.placement.sources import Sources
from xhpc.placement.synthetic import SyntheticInputs, synthetic_inputs
from xhpc.placement.views import deferred_source

NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)


def inputs_of(seed: int, n_nodes: int = 30) -> SyntheticInputs:
    return synthetic_inputs(n_nodes, (2, 4, 8), seed=seed, now=NOW, busy=0.5)


def fresh(inputs: SyntheticInputs, **kw: object) -> ClusterSnapshot:
    return build_snapshot(
        inputs.nodes,
        inputs.jobs,
        inputs.reservations,
        inputs.probes,
        now=NOW,
        probe_ttl_s=inputs.probe_ttl_s,
        **kw,  # type: ignore[arg-type]
    )


def deferred(snap: ClusterSnapshot) -> bool:
    return "nodes" not in snap.__dict__


def eager(snap: ClusterSnapshot) -> ClusterSnapshot:
    """The same snapshot, validated from its dump: every view built, nothing deferred."""
    return ClusterSnapshot.model_validate(snap.model_dump())


class Holder(BaseModel):
    snapshot: ClusterSnapshot


READS = {
    "nodes": lambda s: s.nodes,
    "model_dump": lambda s: s.model_dump(),
    "model_dump_json": lambda s: s.model_dump_json(),
    "dump include": lambda s: s.model_dump(include={"nodes"}),
    "==": lambda s: s == eager(fresh(inputs_of(1))),
    "hash": hash,
    "repr": repr,
    "str": str,
    "iter": lambda s: dict(s),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "model_copy": lambda s: s.model_copy(),
    "model_copy update": lambda s: s.model_copy(update={"probe_ttl_s": 1.0}),
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "type adapter": lambda s: TypeAdapter(list[ClusterSnapshot]).dump_python([s]),
    "nested": lambda s: Holder(snapshot=s).model_dump_json(),
}


@pytest.mark.parametrize("how", READS)
def test_every_read_builds_the_views_first(how: str) -> None:
    inputs = inputs_of(1)
    snap, want = fresh(inputs), eager(fresh(inputs))
    assert deferred(snap)
    got = READS[how](snap)
    assert not deferred(snap)
    assert snap == want and hash(snap) == hash(want) and repr(snap) == repr(want)
    assert list(snap.__dict__) == list(want.__dict__)  # declaration order, as validated
    assert snap.model_fields_set == want.model_fields_set
    # what a deferred snapshot gives is what an eager one gives (copies: whole ones)
    expected = READS[how](want)
    if isinstance(got, ClusterSnapshot):
        assert not deferred(got)
        assert got.model_dump() == expected.model_dump() and got == expected
    else:
        assert got == expected


def test_a_decision_builds_no_view() -> None:
    inputs = inputs_of(2, 200)
    snap = fresh(inputs)
    strategy = get_strategy("idle-first")
    strategy.place(snap, PlacementRequest(gpus=1, replicas=3))
    strategy.place(snap, PlacementRequest(gpus=1, partition="gpu", gpu_type="a100"))
    assert deferred(snap)
    source = deferred_source(snap)
    assert isinstance(source, Sources)
    assert source.views == [None] * len(inputs.nodes)


def test_node_builds_only_that_view_and_nodes_keeps_it() -> None:
    inputs = inputs_of(3)
    snap, want = fresh(inputs), eager(fresh(inputs))
    name = inputs.nodes[7].name
    view = snap.node(name)
    assert deferred(snap) and snap.node("nope") is None
    source = deferred_source(snap)
    assert isinstance(source, Sources)
    assert sum(v is not None for v in source.views) == 1
    assert view == want.node(name)
    assert snap.node(name) is view
    assert snap.nodes[source.index[name]] is view  # the one view, built once
    assert not deferred(snap) and snap.node(name) is view and snap == want


def test_a_failed_decision_names_the_same_problems() -> None:
    inputs = inputs_of(4)
    snap, want = fresh(inputs), eager(fresh(inputs))
    request = PlacementRequest(gpus=8, replicas=40, partition="gpu")
    with pytest.raises(PlacementError) as got:
        get_strategy("pack").place(snap, request)
    with pytest.raises(PlacementError) as ref:
        reference_place(want, request, "pack")
    assert got.value.problems == ref.value.problems


def test_apply_reservations_on_a_deferred_snapshot_stays_deferred() -> None:
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
        assert deferred(snap) and deferred(child) and deferred(grandchild)
        for got, extra in ((child, new), (grandchild, [*new, *new[:1]])):
            rebuilt = build_snapshot(
                inputs.nodes, inputs.jobs, (*inputs.reservations, *extra), inputs.probes, now=NOW
            )
            assert got.model_dump() == rebuilt.model_dump()
            derived, again = arrays_for(got), SnapshotArrays.build(eager(got))
            for field in ("free", "usable", "tainted", "load", "name_rank", "idle_rank"):
                assert np.array_equal(getattr(derived, field), getattr(again, field)), field
        assert snap.model_dump() == fresh(inputs).model_dump()  # the parent is unchanged


def _report(node: str, age_s: float, *gpus: GpuProbe) -> ProbeReport:
    return ProbeReport(
        node=node, taken_at=NOW - timedelta(seconds=age_s), backend="fake", gpus=gpus
    )


def test_probe_reports_seen_again_give_what_new_ones_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report's reading is kept for the next build, by report identity: the same reports, a
    changed one, one now stale, a node whose GPU count changed, all give the views' values."""
    read: list[str] = []
    real = snapshot_module._probe_part

    def counted(probe: ProbeReport, total: int, source: object) -> object:
        read.append(probe.node)
        return real(probe, total, source)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshot_module, "_probe_part", counted)
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
        (nodes, first, NOW, [a, b, c]),
        (nodes, first, NOW, []),  # the same report objects: read before
        (nodes, later, NOW, [a]),  # one replaced
        (nodes, later, NOW + timedelta(seconds=2), []),  # b's report goes stale
        ([*nodes[:2], grown, *nodes[3:]], later, NOW, [c]),  # the same report, more GPUs
    ]
    for step_nodes, probes, now, reads in steps:
        read.clear()
        snap = build_snapshot(step_nodes, inputs.jobs, (), probes, now=now)
        assert sorted(read) == reads
        arrays, views = arrays_for(snap), SnapshotArrays.build(eager(snap))
        for field in ("free", "usable", "tainted", "load", "idle_rank"):
            assert np.array_equal(getattr(arrays, field), getattr(views, field)), field
        assert arrays.tainted[1] == (now == NOW)  # b's foreign memory, while its report is fresh
