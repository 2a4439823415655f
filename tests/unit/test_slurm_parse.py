"""Slurm output parsers, fed the real output captured from the dev cluster (tests/data/slurm)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel

from tests.placement_support.synthetic import sinfo_json, squeue_json, synthetic_inputs
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
_NOW = datetime(2026, 11, 29, 12, 50, tzinfo=UTC)


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


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_sinfo_json, '{"nodes": {"a": 1}}'),
        (parse_sinfo_json, '{"nodes": [1]}'),
        (parse_squeue_json, '{"jobs": "x"}'),
        (parse_squeue_json, '{"jobs": [[]]}'),
    ],
)
def test_json_of_another_shape_is_a_parse_error(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(SlurmParseError, match="unexpected JSON") as info:
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


# -- the fast JSON parsers give what the plain validating ones gave --------------------------------
# `_ref_*` is parse.py as it was before it was made fast (bench/placement.py): plain helpers and
# validated models. The fast parsers must give equal models, with the same `model_fields_set` and
# field types, for every record shape; their records (what placement reads) the same values.
_REF_NO_VAL = {4294967294, 4294967295, 65534, 65535}


def _ref_number(value: Any) -> int | None:
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return None if int(value) in _REF_NO_VAL else int(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _ref_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or None
    s = str(value)
    return s if s and s != "(null)" else None


def _ref_state(value: Any) -> tuple[str, tuple[str, ...]]:
    if isinstance(value, list):
        states = [str(v).upper() for v in value]
        return (states[0] if states else "UNKNOWN"), tuple(states[1:])
    return str(value or "UNKNOWN").upper(), ()


def _ref_sinfo(text: str) -> list[NodeInfo]:
    data = json.loads(text)
    nodes: dict[str, NodeInfo] = {}
    for raw in data.get("nodes", []):
        name = _ref_text(raw.get("name")) or _ref_text(raw.get("hostname"))
        if not name or name in nodes:
            continue
        state, extra_flags = _ref_state(raw.get("state"))
        flags = tuple(str(f).upper() for f in raw.get("state_flags", []) or []) + extra_flags
        total, gtype, _ = parse_gres(_ref_text(raw.get("gres")))
        used, _, used_idx = parse_gres(_ref_text(raw.get("gres_used")))
        nodes[name] = NodeInfo(
            name=name,
            address=_ref_text(raw.get("address")) or name,
            state=state,
            state_flags=flags,
            partitions=tuple(str(p) for p in raw.get("partitions", []) or []),
            gpus_total=total,
            gpus_used=used,
            gpu_type=gtype,
            gpus_used_idx=used_idx,
            cpus=_ref_number(raw.get("cpus")) or 0,
            reason=_ref_text(raw.get("reason")),
        )
    return sorted(nodes.values(), key=lambda n: n.name)


def _ref_job_id(raw: dict[str, Any]) -> str:
    jid = _ref_number(raw.get("job_id"))
    if jid is None:
        raise SlurmParseError("squeue --json: a job without job_id")
    het = _ref_number(raw.get("het_job_id"))
    het_off = _ref_number(raw.get("het_job_offset"))
    if het and het_off is not None:
        return f"{het}+{het_off}"
    arr = _ref_number(raw.get("array_job_id"))
    task = _ref_number(raw.get("array_task_id"))
    if arr and task is not None:
        return f"{arr}_{task}"
    pending_tasks = _ref_text(raw.get("array_task_string"))
    if arr and pending_tasks:
        return f"{arr}_[{pending_tasks}]"
    return str(jid)


def _ref_time(value: Any) -> datetime | None:
    n = _ref_number(value)
    return datetime.fromtimestamp(n, UTC) if n else None


def _ref_squeue(text: str) -> list[JobInfo]:
    data = json.loads(text)
    jobs: list[JobInfo] = []
    for raw in data.get("jobs", []):
        state, _ = _ref_state(raw.get("job_state"))
        details = tuple(str(g) for g in raw.get("gres_detail", []) or [])
        idx: tuple[int, ...] = ()
        for d in details:
            idx = (*idx, *parse_gres(d)[2])
        het = _ref_number(raw.get("het_job_id"))
        arr = _ref_number(raw.get("array_job_id"))
        reason = _ref_text(raw.get("state_reason"))
        jobs.append(
            JobInfo(
                job_id=_ref_job_id(raw),
                raw_job_id=_ref_number(raw.get("job_id")) or 0,
                name=_ref_text(raw.get("name")) or "",
                state=state,
                reason=None if reason in (None, "None") else reason,
                user=_ref_text(raw.get("user_name")),
                partition=_ref_text(raw.get("partition")),
                nodes=_ref_text(raw.get("nodes")),
                batch_host=_ref_text(raw.get("batch_host")),
                comment=_ref_text(raw.get("comment")),
                gpus_idx=idx,
                gres_detail=details,
                het_job_id=het or None,
                het_job_offset=_ref_number(raw.get("het_job_offset")) if het else None,
                array_job_id=arr or None,
                array_task_id=_ref_number(raw.get("array_task_id")) if arr else None,
                time_limit_min=_ref_number(raw.get("time_limit")),
                start_time=_ref_time(raw.get("start_time")),
                restart_count=_ref_number(raw.get("restart_cnt")) or 0,
            )
        )
    return jobs


def _assert_same_models(got: Sequence[BaseModel], want: Sequence[BaseModel]) -> None:
    assert got == want
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        assert g.model_fields_set == w.model_fields_set
        assert [(k, type(v)) for k, v in g.__dict__.items()] == [
            (k, type(v)) for k, v in w.__dict__.items()
        ]
        assert g.model_dump_json() == w.model_dump_json()


def _assert_typed_jobs(got: Sequence[JobInfo], want: Sequence[JobInfo]) -> None:
    """The parser's jobs equal the reference's, and every field has its declared type (a
    JobInfo is a struct that checks nothing when built: msgspec's strict conversion does)."""
    assert got == want
    for g in got:
        checked = msgspec.convert(msgspec.to_builtins(g), JobInfo)
        assert checked == g
        assert [(k, type(v)) for k, v in msgspec.structs.asdict(g).items()] == [
            (k, type(v)) for k, v in msgspec.structs.asdict(checked).items()
        ]


_SINFO_RECORDS: list[dict[str, Any]] = [
    {"name": "a1", "state": "idle", "gres": "gpu:4", "gres_used": "gpu:0", "cpus": 8},
    {"name": "a1", "state": "down", "gres": "gpu:8"},  # a duplicate name: the first one wins
    {"name": "", "hostname": "a2", "state": ["MIXED", "drain"], "gres": "gpu:h100:8(S:0-1)",
     "gres_used": "gpu:h100:2(IDX:0,5)", "cpus": {"set": True, "number": 64}},
    {"hostname": "a3", "state": "", "state_flags": None, "partitions": None, "gres": None,
     "gres_used": "(null)", "cpus": 4294967294, "reason": "(null)", "address": ""},
    {"name": "a4", "state": None, "state_flags": ["drain", 3], "partitions": ["p", 7],
     "gres": "gpu:2(IDX:0-1),mps:100", "gres_used": "N/A", "cpus": "12", "reason": "maint"},
    {"name": "a5", "state": ["IDLE"], "gres": "gpu:a100:0(IDX:N/A)", "cpus": 3.0,
     "address": "10.0.0.5"},
    {"name": "a6", "state": [], "cpus": True, "gres": ["gpu:4"], "gres_used": "gpu:4"},
    {"name": "(null)", "hostname": None},  # no name at all: skipped
    {"name": "a7", "cpus": {"set": False, "number": 8}, "gres_used": "gpu(IDX:0)"},
    {"name": "a8", "cpus": {"set": True, "infinite": True, "number": 8}},
]  # fmt: skip

_SQUEUE_RECORDS: list[dict[str, Any]] = [
    {"job_id": 11, "job_state": "RUNNING", "nodes": "n1", "gres_detail": ["gpu:2(IDX:0-1)"],
     "name": "plain", "user_name": "u", "partition": "gpu", "batch_host": "n1",
     "time_limit": 60, "start_time": 1795956409, "state_reason": "None"},
    {"job_id": 12, "het_job_id": 12, "het_job_offset": 0, "job_state": ["RUNNING"],
     "gres_detail": ["gpu:1(IDX:0)", "gpu:1(IDX:3)"], "nodes": "n[1-2]"},
    {"job_id": 13, "het_job_id": 12, "het_job_offset": {"set": True, "number": 1},
     "job_state": "running"},
    {"job_id": 14, "het_job_id": 12, "het_job_offset": None, "job_state": "PENDING"},
    {"job_id": 15, "array_job_id": 15, "array_task_id": 0, "job_state": "RUNNING",
     "start_time": 1795956409},
    {"job_id": 16, "array_job_id": 15, "array_task_id": None, "array_task_string": "1-3%1",
     "job_state": "PENDING", "state_reason": "JobArrayTaskLimit", "start_time": 0},
    {"job_id": 17, "array_job_id": {"set": False, "number": 0}, "array_task_string": "9",
     "job_state": "", "gres_detail": None, "time_limit": {"set": True, "infinite": True}},
    {"job_id": "18", "job_state": None, "gres_detail": [], "name": None, "comment": "(null)",
     "time_limit": 4294967295, "start_time": "1795956409"},
    {"job_id": 19.0, "job_state": ["COMPLETING", "X"], "nodes": ["n1", "n2"],
     "gres_detail": ["gpu:1(IDX:2)", "gpu:a100:2(IDX:0,1)"], "start_time": {"number": 5}},
    {"job_id": 20, "het_job_id": 0, "array_job_id": 0, "array_task_id": 5, "job_state": "RUNNING"},
]  # fmt: skip


def test_fast_sinfo_parse_equals_the_validating_one(slurm_output: Output) -> None:
    texts = [
        slurm_output("sinfo-idle.json"),
        slurm_output("sinfo-busy.json"),
        json.dumps({"nodes": _SINFO_RECORDS}),
        json.dumps({}),
    ]
    for text in texts:
        _assert_same_models(parse_sinfo_json(text), _ref_sinfo(text))


def test_fast_squeue_parse_equals_the_validating_one(slurm_output: Output) -> None:
    texts = [
        slurm_output("squeue-mixed.json"),
        slurm_output("squeue-empty.json"),
        json.dumps({"jobs": _SQUEUE_RECORDS}),
    ]
    for text in texts:
        _assert_typed_jobs(parse_squeue_json(text), _ref_squeue(text))


@pytest.mark.parametrize("seed", range(5))
def test_fast_parsers_equal_the_validating_ones_on_synthetic_clusters(
    seed: int, slurm_output: Output
) -> None:
    inputs = synthetic_inputs(40 * seed, (1, 2, 4, 8), seed=seed, now=_NOW)
    sinfo = sinfo_json(inputs.nodes, json.loads(slurm_output("sinfo-busy.json")))
    squeue = squeue_json(inputs.jobs, json.loads(slurm_output("squeue-mixed.json")))
    nodes, jobs = parse_sinfo_json(sinfo), parse_squeue_json(squeue)
    # the text gives the inputs back (bench/placement.py relies on it)
    assert nodes == sorted(inputs.nodes, key=lambda n: n.name) and tuple(jobs) == inputs.jobs
    _assert_same_models(nodes, _ref_sinfo(sinfo))
    _assert_typed_jobs(jobs, _ref_squeue(squeue))


def test_squeue_job_without_id_is_still_a_parse_error_among_others() -> None:
    text = json.dumps({"jobs": [*_SQUEUE_RECORDS[:3], {"job_state": "RUNNING"}]})
    with pytest.raises(SlurmParseError, match="without job_id"):
        parse_squeue_json(text)


def test_parse_gres_remembers_results_not_errors() -> None:
    assert parse_gres("gpu:l40s:3(IDX:0-2)") is parse_gres("gpu:l40s:3(IDX:0-2)")
    for _ in range(2):
        with pytest.raises(SlurmParseError):
            parse_gres("gpu:2(IDX:x-y)")
