"""Slurm output parsers, fed the real output captured from the dev cluster (tests/data/slurm)."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from xhpc.errors import SlurmParseError
from xhpc.models import JobInfo, NodeInfo
from xhpc.slurm.parse import (
    parse_gres,
    parse_index_list,
    parse_sbatch_parsable,
    parse_sinfo_json,
    parse_squeue_json,
)

Output = Callable[[str], str]


# -- sinfo ----------------------------------------------------------------------------------------
def test_sinfo_idle_lists_three_usable_nodes_with_addresses(idle_nodes: list[NodeInfo]) -> None:
    assert [(n.name, n.address) for n in idle_nodes] == [
        ("n1", "10.77.0.11"),
        ("n2", "10.77.0.12"),
        ("n3", "10.77.0.13"),
    ]
    for node in idle_nodes:
        assert node.state == "IDLE"
        assert node.state_flags == ()
        assert node.partitions == ("gpu",)
        assert (node.gpus_total, node.gpus_used, node.gpu_type) == (4, 0, None)
        assert node.cpus == 8
        assert node.reason is None
        assert node.usable


def test_sinfo_busy_counts_used_gpus_and_marks_drain_unusable(busy_nodes: list[NodeInfo]) -> None:
    by_name = {n.name: n for n in busy_nodes}
    assert {n: (by_name[n].state, by_name[n].gpus_used) for n in by_name} == {
        "n1": ("MIXED", 4),
        "n2": ("MIXED", 3),
        "n3": ("MIXED", 1),
    }
    assert all(n.gpus_total == 4 for n in busy_nodes)
    assert by_name["n3"].state_flags == ("DRAIN",)
    assert by_name["n3"].reason == "test"
    assert not by_name["n3"].usable
    assert by_name["n1"].usable and by_name["n2"].usable
    # sinfo prints an empty reason for healthy nodes: that is "no reason", not "".
    assert by_name["n1"].reason is None


@pytest.mark.parametrize(
    ("state", "flags", "usable"),
    [
        ("IDLE", (), True),
        ("MIXED", (), True),
        ("ALLOCATED", (), True),
        ("DOWN", (), False),
        ("IDLE", ("DRAIN",), False),
        ("MIXED", ("drain",), False),
        ("IDLE", ("NOT_RESPONDING",), False),
        ("drained", (), False),
    ],
)
def test_node_usable(state: str, flags: tuple[str, ...], usable: bool) -> None:
    node = NodeInfo(name="n", address="n", state=state, state_flags=flags)
    assert node.usable is usable


def test_sinfo_newer_shape_state_list_and_number_objects() -> None:
    """Slurm >= 23 prints state as a list and numbers as {"set", "number"} objects."""
    text = (
        '{"nodes": [{"name": "g1", "address": "10.0.0.1", "state": ["IDLE", "DRAIN"],'
        ' "cpus": {"set": true, "number": 64}, "gres": "gpu:h100:8(S:0-1)",'
        ' "gres_used": "gpu:h100:2(IDX:0,5)", "partitions": ["a", "b"]}]}'
    )
    (node,) = parse_sinfo_json(text)
    assert (node.state, node.state_flags, node.cpus) == ("IDLE", ("DRAIN",), 64)
    assert (node.gpus_total, node.gpus_used, node.gpu_type) == (8, 2, "h100")
    assert node.gpus_used_idx == (0, 5)
    assert node.partitions == ("a", "b")
    assert not node.usable


# -- squeue ---------------------------------------------------------------------------------------
@pytest.fixture
def mixed_jobs(slurm_output: Output) -> dict[str, JobInfo]:
    jobs = parse_squeue_json(slurm_output("squeue-mixed.json"))
    assert len(jobs) == 10
    by_id = {j.job_id: j for j in jobs}
    assert len(by_id) == 10, "every record gets a distinct job id"
    return by_id


def test_squeue_job_ids_cover_plain_het_array_and_pending_array(
    mixed_jobs: dict[str, JobInfo],
) -> None:
    assert set(mixed_jobs) == {
        "1", "2", "3+0", "3+1", "5_0", "5_1", "5_2", "6", "7_0", "7_[1-3%1]",
    }  # fmt: skip
    for job_id in mixed_jobs:
        assert re.fullmatch(r"\d+(\+\d+|_\d+|_\[[^\]]+\])?", job_id)


def test_squeue_het_components_keep_leader_and_offset(mixed_jobs: dict[str, JobInfo]) -> None:
    lead, second = mixed_jobs["3+0"], mixed_jobs["3+1"]
    assert (lead.raw_job_id, lead.het_job_id, lead.het_job_offset) == (3, 3, 0)
    assert (second.raw_job_id, second.het_job_id, second.het_job_offset) == (4, 3, 1)
    assert (lead.batch_host, second.batch_host) == ("n2", "n3")
    assert lead.gpus_idx == second.gpus_idx == (0,)


def test_squeue_array_tasks(mixed_jobs: dict[str, JobInfo]) -> None:
    task = mixed_jobs["5_0"]
    assert (task.array_job_id, task.array_task_id, task.raw_job_id) == (5, 0, 8)
    assert task.het_job_id is None and task.het_job_offset is None
    assert [mixed_jobs[f"5_{i}"].gpus_idx for i in range(3)] == [(3,), (1,), (2,)]
    pending = mixed_jobs["7_[1-3%1]"]
    assert (pending.state, pending.reason) == ("PENDING", "JobArrayTaskLimit")
    assert (pending.array_job_id, pending.array_task_id) == (7, None)
    assert pending.start_time is None


def test_squeue_running_job_fields(mixed_jobs: dict[str, JobInfo]) -> None:
    job = mixed_jobs["1"]
    assert job.name == "capture-gpu2"
    assert job.state == "RUNNING"
    assert job.reason is None, 'Slurm\'s reason "None" means no reason'
    assert (job.nodes, job.batch_host, job.partition, job.user) == ("n1", "n1", "gpu", "root")
    assert job.comment == "capture-comment"
    assert job.gres_detail == ("gpu:2(IDX:0-1)",)
    assert job.gpus_idx == (0, 1)
    assert job.time_limit_min == 1440
    assert job.start_time is not None and job.start_time.tzinfo is not None
    assert job.start_time == datetime(2026, 11, 29, 12, 46, 49, tzinfo=UTC)
    assert mixed_jobs["2"].gpus_idx == (2,)
    assert mixed_jobs["2"].comment is None


def test_squeue_pending_job_has_reason_and_no_host(mixed_jobs: dict[str, JobInfo]) -> None:
    job = mixed_jobs["6"]
    assert (job.state, job.reason) == ("PENDING", "Resources")
    assert job.batch_host is None and job.nodes is None
    assert job.gpus_idx == () and job.gres_detail == ()


def test_squeue_job_without_gres_has_no_gpus(mixed_jobs: dict[str, JobInfo]) -> None:
    assert mixed_jobs["7_0"].state == "RUNNING"
    assert mixed_jobs["7_0"].gpus_idx == ()


def test_squeue_empty(slurm_output: Output) -> None:
    assert parse_squeue_json(slurm_output("squeue-empty.json")) == []


@pytest.mark.parametrize("parse", [parse_sinfo_json, parse_squeue_json])
@pytest.mark.parametrize("text", ["", "not json", '{"jobs": [', "[1, 2]", '"text"'])
def test_malformed_json_is_a_parse_error(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse(text)
    assert info.value.stdout == text


def test_squeue_job_without_id_is_a_parse_error() -> None:
    with pytest.raises(SlurmParseError, match="without job_id"):
        parse_squeue_json('{"jobs": [{"name": "x", "job_state": "RUNNING"}]}')


# -- sbatch --parsable ----------------------------------------------------------------------------
def test_sbatch_parsable_every_captured_id(slurm_output: Output) -> None:
    lines = slurm_output("sbatch-parsable.txt").splitlines()
    pairs = [(lines[i], lines[i + 1]) for i in range(0, len(lines), 2)]
    assert all(cmd.startswith("# sbatch --parsable") for cmd, _ in pairs)
    ids = [parse_sbatch_parsable(out + "\n") for _, out in pairs]
    # het.sbatch prints only the leader's id (3); its second component is job 4.
    assert ids == ["1", "2", "3", "5", "6", "7"]


@pytest.mark.parametrize(
    ("text", "job_id"),
    [("42\n", "42"), ("42;cluster-a\n", "42"), ("  17  ", "17"), ("warning: x\n99\n", "99")],
)
def test_sbatch_parsable_forms(text: str, job_id: str) -> None:
    assert parse_sbatch_parsable(text) == job_id


@pytest.mark.parametrize("text", ["", "\n\n", "Submitted batch job 12", "12abc", "-1"])
def test_sbatch_parsable_rejects_non_ids(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sbatch_parsable(text)


# -- GRES strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu:4", (4, None, ())),
        ("gpu:a100:4(S:0-1)", (4, "a100", ())),
        ("gpu:2(IDX:0-1)", (2, None, (0, 1))),
        ("gpu:0(IDX:N/A)", (0, None, ())),
        ("gpu:a100:0(IDX:N/A)", (0, "a100", ())),
        ("gpu:2(IDX:0,2)", (2, None, (0, 2))),
        ("gpu(IDX:0)", (1, None, (0,))),
        ("gpu:a100:2(S:0|IDX:1-2)", (2, "a100", (1, 2))),
        ("gpu:tesla-v100:2", (2, "tesla-v100", ())),
        ("gpu:a100:2(IDX:0-1),gpu:v100:1(IDX:3)", (3, "a100", (0, 1, 3))),
        ("mps:100,gpu:1(IDX:2)", (1, None, (2,))),
        ("shard:8", (0, None, ())),
        ("(null)", (0, None, ())),
        ("N/A", (0, None, ())),
        ("", (0, None, ())),
        (None, (0, None, ())),
    ],
)
def test_parse_gres(text: str | None, expected: tuple[int, str | None, tuple[int, ...]]) -> None:
    assert parse_gres(text) == expected


def test_parse_gres_other_name() -> None:
    assert parse_gres("gpu:2(IDX:0-1),mps:100", name="mps") == (100, None, ())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", (0,)),
        ("0-1", (0, 1)),
        ("0-1,3", (0, 1, 3)),
        ("0,2-4,7", (0, 2, 3, 4, 7)),
        (" 1 , 2 ", (1, 2)),
        ("N/A", ()),
        ("n/a", ()),
        ("", ()),
    ],
)
def test_parse_index_list(text: str, expected: tuple[int, ...]) -> None:
    assert parse_index_list(text) == expected
