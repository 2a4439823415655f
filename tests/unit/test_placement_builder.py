"""A SnapshotBuilder fed poll after poll gives, every time, what a fresh build gives.

The builder keeps per-node values between builds and computes again only what changed (by object
identity: the nodes, the jobs, the probe reports). Each build of a sequence of seeded polls (nodes,
jobs and reports replaced, added, removed, reordered, listed twice; time passing so that reports
go stale) must equal the reference build of the same inputs (test_placement_ingest: views,
dumps, arrays), on synthetic clusters and on the captured Slurm output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from tests.placement_support.synthetic import synthetic_inputs
from tests.unit.test_placement_ingest import assert_same_snapshot, reference_build
from xhpc.models import GpuProbe, JobInfo, NodeInfo, ProbeReport, Reservation
from xhpc.placement import SnapshotBuilder, apply_reservations, build_snapshot
from xhpc.slurm.parse import parse_squeue_json

NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)
Output = Callable[[str], str]


def _changed_node(rng: random.Random, node: NodeInfo) -> NodeInfo:
    choices: list[dict[str, object]] = [
        {"reason": f"r{rng.random()}"},  # another object, the same placement values
        {"state": rng.choice(("IDLE", "MIXED", "DOWN")), "state_flags": ()},
        {"state_flags": ("DRAIN",)},
        {"gpus_used": rng.randint(0, node.gpus_total + 1)},
        {"gpus_used_idx": (0, node.gpus_total - 1, 99)},
        {"gpus_total": rng.choice((0, 2, 8, 16))},
        {"partitions": rng.choice(((), ("gpu",), ("debug", "new")))},
        {"gpu_type": rng.choice((None, "a100", "l40"))},
    ]
    return node.model_copy(update=rng.choice(choices))


def _changed_job(rng: random.Random, job: JobInfo, names: list[str]) -> JobInfo:
    host = rng.choice(names) if names else "nowhere"
    choices: list[dict[str, object]] = [
        {"name": "renamed"},  # another object, the same GPUs
        {"state": rng.choice(("PENDING", "COMPLETED", "running", "SUSPENDED"))},
        {"nodes": host, "gres_detail": (f"gpu:2(IDX:{rng.randint(0, 3)},5)",)},
        {"nodes": host, "gres_detail": (), "gpus_idx": (1,)},
    ]
    return msgspec.structs.replace(job, **rng.choice(choices))


def _new_report(rng: random.Random, name: str, now: datetime) -> ProbeReport:
    gpus = tuple(
        GpuProbe(
            index=rng.choice((i, i, i, i + 1)),
            util_pct=10.0 * rng.randint(0, 10),
            mem_used_mb=1.0 * rng.randint(0, 8),
            mem_total_mb=8.0,
            healthy=rng.random() > 0.2,
        )
        for i in range(rng.randint(0, 9))
    )
    taken = now - timedelta(seconds=rng.choice((0.5, 10.0, 29.0, 31.0)))
    return ProbeReport(node=name, taken_at=taken, backend="fake", gpus=gpus)


def _next_poll(
    rng: random.Random,
    nodes: list[NodeInfo],
    jobs: list[JobInfo],
    probes: dict[str, ProbeReport],
    now: datetime,
) -> None:
    """Change some of the inputs in place, as a later poll would."""
    for i in rng.sample(range(len(nodes)), k=min(len(nodes), rng.randint(0, 4))):
        nodes[i] = _changed_node(rng, nodes[i])
    names = [n.name for n in nodes]
    for i in rng.sample(range(len(jobs)), k=min(len(jobs), rng.randint(0, 6))):
        jobs[i] = _changed_job(rng, jobs[i], names)
    roll = rng.random()
    if roll < 0.15 and nodes:  # a node leaves
        nodes.pop(rng.randrange(len(nodes)))
    elif roll < 0.3:  # a node joins (the input no longer sorted)
        nodes.append(NodeInfo(name=f"x{rng.randint(0, 99)}", address="a", state="IDLE"))
    roll = rng.random()
    if roll < 0.15 and jobs:
        jobs.pop(rng.randrange(len(jobs)))
    elif roll < 0.3 and jobs:
        jobs.append(rng.choice(jobs))  # the same object twice
    elif roll < 0.45:
        rng.shuffle(jobs)
    for name in rng.sample(names, k=min(len(names), rng.randint(0, 4))):
        if rng.random() < 0.2:
            probes.pop(name, None)
        else:
            probes[name] = _new_report(rng, name, now)


@pytest.mark.parametrize("seed", range(25))
def test_poll_after_poll_equals_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    inputs = synthetic_inputs(
        rng.randint(0, 30), (2, 4, 8), seed=seed, now=NOW, busy=rng.choice((0.3, 0.7))
    )
    nodes, jobs, probes = list(inputs.nodes), list(inputs.jobs), dict(inputs.probes)
    builder = SnapshotBuilder()
    now = NOW
    for _ in range(12):
        reservations = rng.sample(inputs.reservations, k=len(inputs.reservations) // 2)
        got = builder.build(
            nodes, jobs, reservations, probes, now=now, probe_ttl_s=inputs.probe_ttl_s
        )
        want = reference_build(
            nodes, jobs, reservations, probes, now=now, probe_ttl_s=inputs.probe_ttl_s
        )
        assert_same_snapshot(got, want)
        if got.arrays.names and rng.random() < 0.3:  # the ledger's path after a build
            one = Reservation(replica_id="z", node=got.arrays.names[0], gpus=1, created_at=now)
            assert_same_snapshot(
                apply_reservations(got, [one]),
                reference_build(nodes, jobs, [*reservations, one], probes, now=now),
            )
        now += timedelta(seconds=rng.choice((0.0, 1.0, 20.0)))
        _next_poll(rng, nodes, jobs, probes, now)


def test_a_snapshot_does_not_change_with_later_builds() -> None:
    inputs = synthetic_inputs(20, 4, seed=3, now=NOW)
    nodes, jobs, probes = list(inputs.nodes), list(inputs.jobs), dict(inputs.probes)
    builder = SnapshotBuilder()
    first = builder.build(nodes, jobs, inputs.reservations, probes, now=NOW)
    want = reference_build(nodes, jobs, inputs.reservations, probes, now=NOW)
    rng = random.Random(3)
    for _ in range(5):
        _next_poll(rng, nodes, jobs, probes, NOW)
        builder.build(nodes, jobs, (), probes, now=NOW + timedelta(seconds=40))
    assert_same_snapshot(first, want)


def test_captured_output_poll_after_poll(
    busy_nodes: list[NodeInfo], idle_nodes: list[NodeInfo], slurm_output: Output
) -> None:
    jobs = parse_squeue_json(slurm_output("squeue-mixed.json"))
    builder = SnapshotBuilder()
    res = [Reservation(replica_id="a", node="n2", gpus=1, created_at=NOW)]
    for nodes, some_jobs in (
        (busy_nodes, jobs),
        (busy_nodes, jobs),
        (idle_nodes, jobs),
        (idle_nodes, jobs[:3]),
        (busy_nodes, []),
        (busy_nodes, jobs),
    ):
        got = builder.build(nodes, some_jobs, res, now=NOW)
        assert_same_snapshot(got, reference_build(nodes, some_jobs, res, now=NOW))


def test_a_failed_build_leaves_a_builder_that_builds_right() -> None:
    inputs = synthetic_inputs(10, 4, seed=5, now=NOW)
    builder = SnapshotBuilder()
    builder.build(inputs.nodes, inputs.jobs, (), inputs.probes, now=NOW)
    name = inputs.nodes[0].name
    naive = ProbeReport(node=name, taken_at=datetime(2026, 1, 1), backend="fake")
    with pytest.raises(TypeError):
        builder.build(inputs.nodes, inputs.jobs, (), {**inputs.probes, name: naive}, now=NOW)
    with pytest.raises(ValueError, match="timezone-aware"):
        builder.build(inputs.nodes, inputs.jobs, now=datetime(2026, 1, 1))
    jobs = inputs.jobs[1:]
    got = builder.build(inputs.nodes, jobs, (), inputs.probes, now=NOW)
    assert_same_snapshot(got, reference_build(inputs.nodes, jobs, (), inputs.probes, now=NOW))


def test_an_unchanged_poll_computes_no_row(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = synthetic_inputs(30, 8, seed=7, now=NOW)
    nodes = list(inputs.nodes)
    builder = SnapshotBuilder()
    first = builder.build(nodes, inputs.jobs, (), inputs.probes, now=NOW)
    rows = builder._rows
    computed: list[int] = []
    compute = rows._compute

    def counted(at: Sequence[int], probes: Mapping[str, ProbeReport]) -> None:
        computed.extend(at)
        compute(at, probes)

    monkeypatch.setattr(rows, "_compute", counted)
    nodes[3] = nodes[3].model_copy(update={"reason": "other text"})
    later = builder.build(nodes, inputs.jobs, (), inputs.probes, now=NOW + timedelta(seconds=1))
    assert computed == []
    assert later.arrays.partitions is first.arrays.partitions  # (nothing moved)
    nodes[4] = nodes[4].model_copy(update={"gpus_used": 0, "gpus_used_idx": ()})
    again = builder.build(nodes, inputs.jobs, (), inputs.probes, now=NOW)
    assert computed == [4]
    assert again.view() == build_snapshot(nodes, inputs.jobs, (), inputs.probes, now=NOW).view()
