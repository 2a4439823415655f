"""Invariants of both strategies on many seeded random snapshots, against the brute force."""

from __future__ import annotations

import functools
import random
from collections import Counter
from datetime import UTC, datetime

import numpy as np
import pytest

from tests.placement_support.reference import reference_place
from tests.placement_support.synthetic import synthetic_inputs, synthetic_snapshot
from xhpc.models import Reservation
from xhpc.placement import (
    ClusterSnapshot,
    PlacementError,
    PlacementRequest,
    SnapshotArrays,
    apply_reservations,
    arrays_for,
    build_snapshot,
    get_strategy,
)
from xhpc.placement.request import is_candidate

NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)
SNAPSHOTS = 300
REQUESTS_PER_SNAPSHOT = 6


def random_request(rng: random.Random, snap: ClusterSnapshot) -> PlacementRequest:
    names = [n.name for n in snap.nodes]
    listed: tuple[str, ...] = ()
    if names and rng.random() < 0.2:
        listed = (*rng.sample(names, k=rng.randint(1, len(names))), "not-a-node")
    request = PlacementRequest(
        gpus=rng.choice((1, 1, 2, 2, 3, 4, 8)),
        replicas=rng.choice((1, 1, 2, 3, 6, 12)),
        partition=rng.choice((None, None, "gpu", "long", "debug", "nope")),
        gpu_type=rng.choice((None, None, None, "a100", "h100", "v100")),
        nodes=listed,
    )
    if names and rng.random() < 0.5:  # the weights cache: some nodes hold the model locally
        local = {*rng.sample(names, k=rng.randint(1, len(names))), "not-a-node"}
        request = request.model_copy(update={"model": "m", "local_nodes": frozenset(local)})
    return request


@functools.cache
def cases() -> list[tuple[int, ClusterSnapshot]]:
    """Built at first use, not at import: collection (once per pytest-xdist worker) stays quick."""
    out = []
    for seed in range(SNAPSHOTS):
        rng = random.Random(seed)
        snap = synthetic_snapshot(
            rng.randint(0, 24),
            rng.choice(((4,), (8,), (1, 2, 4, 8), (2, 4))),
            seed=seed,
            now=NOW,
            busy=rng.choice((0.1, 0.4, 0.7)),
        )
        out.append((seed, snap))
    return out


@pytest.mark.parametrize("name", ["idle-first", "pack"])
def test_random_snapshots_agree_with_reference_and_never_over_allocate(name: str) -> None:
    strategy = get_strategy(name)
    decisions = placed_any = failed = 0
    for seed, snap in cases():
        rng = random.Random(seed * 7919 + len(name))
        before = snap.view().model_dump()
        for _ in range(REQUESTS_PER_SNAPSHOT):
            request = random_request(rng, snap)
            decisions += 1
            try:
                got = strategy.place(snap, request)
            except PlacementError as err:
                failed += 1
                with pytest.raises(PlacementError) as ref:
                    reference_place(snap, request, name)
                assert (ref.value.fitted, ref.value.problems) == (err.fitted, err.problems)
                assert 0 <= err.fitted < request.replicas
                continue
            placed_any += 1
            assert got == reference_place(snap, request, name), (seed, request)
            assert [p.replica for p in got] == list(range(request.replicas))
            use = Counter[str]()
            for p in got:
                use[p.node] += p.gpus
            for node_name, gpus in use.items():
                node = snap.node(node_name)
                assert node is not None and is_candidate(node, request)
                # never more than the GPUs nobody holds, that are sound, less the reservations
                spare = [
                    g for g in node.gpus if not g.slurm_jobs and not g.unattributed
                    and g.healthy and not g.foreign
                ]  # fmt: skip
                assert gpus <= len(spare) - node.reserved
        assert snap.view().model_dump() == before, seed
    # the random mix exercises both outcomes
    assert decisions == SNAPSHOTS * REQUESTS_PER_SNAPSHOT
    assert placed_any > decisions // 5 and failed > decisions // 10


def test_arrays_are_read_only_and_the_snapshot_s_own() -> None:
    snap = cases()[5][1]
    arrays = arrays_for(snap)
    assert arrays is snap.arrays
    with pytest.raises(ValueError):
        arrays.free[0] = 99
    assert len(SnapshotArrays.from_views(snap.nodes[:1]).names) == 1


def test_apply_reservations_equals_a_rebuild_with_them() -> None:
    strategy = get_strategy("idle-first")
    for seed in range(40):
        rng = random.Random(seed)
        inputs = synthetic_inputs(rng.randint(1, 20), (2, 4, 8), seed=seed, now=NOW)
        snap = build_snapshot(
            inputs.nodes, inputs.jobs, inputs.reservations, inputs.probes, now=NOW
        )
        before = snap.view().model_dump()
        names = [n.name for n in inputs.nodes] + ["not-a-node"]
        new = [
            Reservation(
                replica_id=f"x{i}", node=rng.choice(names), gpus=rng.randint(1, 3), created_at=NOW
            )
            for i in range(rng.randint(1, 4))
        ]
        child = apply_reservations(snap, new)
        rebuilt = build_snapshot(
            inputs.nodes, inputs.jobs, (*inputs.reservations, *new), inputs.probes, now=NOW
        )
        assert child.view().model_dump() == rebuilt.view().model_dump()
        assert snap.view().model_dump() == before
        derived, fresh = arrays_for(child), SnapshotArrays.from_views(child.nodes)
        for field in ("free", "usable", "tainted", "load", "name_rank", "idle_rank"):
            assert np.array_equal(getattr(derived, field), getattr(fresh, field)), field
        request = PlacementRequest(gpus=rng.choice((1, 2, 4)), replicas=rng.randint(1, 4))
        try:
            got = strategy.place(child, request)
        except PlacementError as err:
            with pytest.raises(PlacementError) as ref:
                reference_place(rebuilt, request, "idle-first")
            assert ref.value.problems == err.problems
        else:
            assert got == reference_place(rebuilt, request, "idle-first")
