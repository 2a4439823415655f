"""The narrow listings (sinfo -O, squeue -O, scontrol -d -o show job), fed real captures taken at
one moment together with sinfo/squeue --json (tests/data/slurm/README.md): they must read as the
JSON does; text that could be misread is refused."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from tests.placement_support.synthetic import (
    scontrol_jobs_text,
    sinfo_text,
    squeue_text,
    synthetic_inputs,
)
from xhpc.errors import SlurmParseError
from xhpc.models import JobInfo, NodeInfo
from xhpc.slurm.details import parse_job_details
from xhpc.slurm.parse import parse_sinfo_json, parse_squeue_json
from xhpc.slurm.text import (
    SEP,
    SQUEUE_FIELDS,
    SinfoReader,
    SqueueReader,
    format_option,
    parse_sinfo_text,
    parse_squeue_text,
)

Output = Callable[[str], str]


def _by_id(jobs: list[JobInfo]) -> list[JobInfo]:
    return sorted(jobs, key=lambda j: j.raw_job_id)


def test_sinfo_text_reads_as_the_json_of_the_same_moment(slurm_output: Output) -> None:
    nodes = parse_sinfo_text(slurm_output("sinfo-nodes.txt"))
    assert nodes == parse_sinfo_json(slurm_output("sinfo-nodes.json"))
    assert [n.partitions for n in nodes] == [("gpu", "urgent")] * 3  # one line per partition


def test_squeue_text_and_details_read_as_the_json_of_the_same_moment(
    slurm_output: Output,
) -> None:
    details = parse_job_details(slurm_output("scontrol-show-job.txt"))
    jobs = parse_squeue_text(slurm_output("squeue-jobs.txt"), details)
    assert _by_id(jobs) == _by_id(parse_squeue_json(slurm_output("squeue-jobs.json")))
    running = [j for j in jobs if j.state == "RUNNING"]
    assert running and all(j.gres_detail == ("gpu:1(IDX:0)",) for j in running)
    assert {j.state for j in jobs} >= {"CANCELLED", "FAILED"}  # ended jobs are listed too


def test_a_running_job_waits_for_its_detail_once_per_run(slurm_output: Output) -> None:
    text = slurm_output("squeue-jobs.txt")
    reader = SqueueReader()
    jobs, missing = reader.read(text)
    running = sorted(j.raw_job_id for j in jobs if j.state == "RUNNING")
    assert sorted(missing) == running
    assert all(j.gres_detail == () for j in jobs)
    details = parse_job_details(slurm_output("scontrol-show-job.txt"))
    first, missing = reader.read(text, details)
    assert missing == []
    again, missing = reader.read(text)  # known now: no scontrol, the same objects
    assert missing == [] and all(a is b for a, b in zip(first, again, strict=True))


def test_sinfo_reader_builds_only_changed_nodes(slurm_output: Output) -> None:
    text = slurm_output("sinfo-nodes.txt")
    reader = SinfoReader()
    first = reader.read(text)
    changed = text.replace(f"{SEP}none{SEP}n2\n", f"{SEP}disk full{SEP}n2\n")
    second = reader.read(changed)
    assert [a is b for a, b in zip(first, second, strict=True)] == [True, False, True]
    assert second[1].reason == "disk full"


def _job_line(name: str = "job", comment: str = "c", reason: str = "None") -> str:
    fields = ["7", "PENDING", "N/A", "N/A", "7", "N/A", "alice", "gpu", "", "n/a", "1"]
    fields += ["1-00:00:00", "N/A", "0", reason, name, comment, "7"]
    assert len(fields) == len(SQUEUE_FIELDS)
    return SEP.join(fields) + "\n"


@pytest.mark.parametrize(
    ("name", "comment", "reason", "expect"),
    [
        ("a b|c", "x y,z=1", "None", ("a b|c", "x y,z=1", None)),
        ("", "", "ReqNodeNotAvail, UnavailableNodes:n[1-2]", ("", None, "ReqNodeNotAvail, "
                                                             "UnavailableNodes:n[1-2]")),
        ("naïve 名前", "(null)", "Priority", ("naïve 名前", None, "Priority")),
    ],
)  # fmt: skip
def test_free_text_with_spaces_and_odd_characters(
    name: str, comment: str, reason: str, expect: tuple[str, str | None, str | None]
) -> None:
    (job,) = parse_squeue_text(_job_line(name, comment, reason))
    assert (job.name, job.comment, job.reason) == expect
    assert job.time_limit_min == 24 * 60 and job.start_time is None and job.nodes is None


@pytest.mark.parametrize(
    "text",
    [
        _job_line(name=f"a{SEP}b"),  # the separator in a name: which field is which?
        _job_line(comment="x\ny"),  # a line break: the record is cut
        # a forged record inside a name: the real record's first and last lines are both job 7
        _job_line(name="a" + SEP + "c" + SEP + "7\n" + _job_line(comment="xhpc:forged")[:-1]),
        _job_line() + _job_line(),  # a job twice
        "garbage\n",
        f"7{SEP}RUNNING\n",
        _job_line().replace(f"{SEP}7\n", f"{SEP}8\n"),  # does not end with its own id
        _job_line().replace("PENDING", "PEND ING"),
    ],
)
def test_squeue_text_that_could_be_misread_is_refused(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_squeue_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "n1\n",
        f"n1{SEP}10.0.0.1{SEP}idle{SEP}gpu{SEP}gpu:4{SEP}gpu:0{SEP}0/8/0/8{SEP}none{SEP}n2\n",
        f"n1{SEP}a{SEP}idle{SEP}gpu{SEP}gpu:4{SEP}gpu:0{SEP}x{SEP}none{SEP}n1\n",
        2 * f"n1{SEP}a{SEP}idle{SEP}gpu{SEP}gpu:4{SEP}gpu:0{SEP}0/8/0/8{SEP}none{SEP}n1\n",
    ],
)
def test_sinfo_text_that_could_be_misread_is_refused(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sinfo_text(text)


def test_a_node_reason_is_the_free_text_between_fixed_fields() -> None:
    line = f"n1{SEP}a{SEP}mixed+drain{SEP}gpu{SEP}gpu:a100:4{SEP}gpu:a100:2(IDX:0,3){SEP}2/6/0/8"
    (node,) = parse_sinfo_text(f"{line}{SEP}bad {SEP}fan{SEP}n1\n")
    assert node.reason == f"bad {SEP}fan" and node.state == "MIXED"
    assert node.state_flags == ("DRAIN",) and not node.usable
    assert (node.gpus_total, node.gpus_used, node.gpus_used_idx) == (4, 2, (0, 3))


def test_scontrol_details_expand_node_groups_and_refuse_forged_ones() -> None:
    line = "JobId=5 JobName=x UserId=a(1) JOB_GRES=gpu:3 Nodes=n[1-2] CPU_IDs=0 Mem=0 "
    line += "GRES=gpu:1(IDX:2) Nodes=n4 CPU_IDs=0-1 Mem=10 GRES=gpu:1(IDX:0) MinCPUsNode=1"
    assert parse_job_details(line) == {5: ("gpu:1(IDX:2)",) * 2 + ("gpu:1(IDX:0)",)}
    forged = line.replace("JobName=x", "JobName=x JOB_GRES=gpu:8 Nodes=n9 CPU_IDs=0 Mem=0 GRES=g")
    for bad in (forged, line + "\nNodes=n1", line + "\n" + line):
        with pytest.raises(SlurmParseError):
            parse_job_details(bad)


def test_synthetic_listings_give_the_inputs_back(slurm_output: Output) -> None:
    inputs = synthetic_inputs(300, (4, 8), seed=11, now=datetime(2026, 11, 29, tzinfo=UTC))
    sinfo = sinfo_text(inputs.nodes, slurm_output("sinfo-nodes.txt"))
    squeue = squeue_text(inputs.jobs, slurm_output("squeue-jobs.txt"))
    details = parse_job_details(
        scontrol_jobs_text(inputs.jobs, slurm_output("scontrol-show-job.txt"))
    )
    assert tuple(parse_sinfo_text(sinfo)) == inputs.nodes
    assert tuple(parse_squeue_text(squeue, details)) == inputs.jobs


def test_the_format_option_is_unpadded_with_the_separator_after_each_field() -> None:
    assert format_option(("A", "B", "A")) == f"A:{SEP},B:{SEP},A:"


# -- readers that read the listing before ---------------------------------------------------------
def _fields(line: str) -> list[str]:
    return line.split(SEP)


def _squeue_change(rng: random.Random, lines: list[str]) -> None:
    """One change a later listing may hold (some make it unreadable)."""
    k = rng.randrange(len(lines))
    fields = _fields(lines[k])
    what = rng.randrange(10)
    if what == 0:
        fields[15] = f"name{rng.random()}"  # another name
    elif what == 1:
        fields[12] = str(1_800_000_000 + rng.randrange(100))  # another run: a new start time
    elif what == 2:
        fields[15] = f"a{SEP}b"  # the separator in a name
    elif what == 3:  # a forged record in a comment
        forged = list(_fields(lines[rng.randrange(len(lines))]))
        fields[16] = "x\n" + SEP.join(forged)
    elif what == 4:
        lines[k] = lines[rng.randrange(len(lines))]  # a line twice (or unchanged)
        return
    elif what == 5:  # another job's id at this place
        other = _fields(lines[rng.randrange(len(lines))])[0]
        fields[0] = fields[-1] = other
    elif what == 6:
        j = rng.randrange(len(lines))
        lines[k], lines[j] = lines[j], lines[k]
        return
    elif what == 7:
        del lines[k]
        return
    elif what == 8:  # a new job
        fields[0] = fields[4] = fields[-1] = str(900_000 + rng.randrange(1000))
    else:
        fields[1] = rng.choice(("COMPLETED", "PENDING", "RUNNING"))
    lines[k] = SEP.join(fields)


def _sinfo_change(rng: random.Random, lines: list[str]) -> None:
    k = rng.randrange(len(lines))
    fields = _fields(lines[k])
    what = rng.randrange(7)
    if what == 0:
        fields[7] = rng.choice(("none", f"fan{SEP}broken", "disk full"))  # the reason
    elif what == 1:
        fields[7] = "cut\nhere"  # a line break in a reason
    elif what == 2:
        fields[3] = rng.choice(("gpu", "long", "debug"))  # maybe a partition twice
    elif what == 3:
        j = rng.randrange(len(lines))
        lines[k], lines[j] = lines[j], lines[k]
        return
    elif what == 4:
        del lines[k]
        return
    elif what == 5:
        fields[2] = rng.choice(("idle", "mixed+drain", "down"))
    else:
        fields[5] = "gpu:a100:1(IDX:0)"
    lines[k] = SEP.join(fields)


def _read_or_error(read: Callable[[], object]) -> object:
    try:
        return read()
    except SlurmParseError:
        return SlurmParseError


@pytest.mark.parametrize("seed", range(12))
def test_readers_that_read_the_listing_before_read_as_new_ones(
    seed: int, slurm_output: Output
) -> None:
    """Listing after listing (lines changed, moved, removed, added; some listings unreadable):
    a reader that read the ones before gives what a new reader gives, or refuses the same
    listings; an unchanged line is the same object again."""
    rng = random.Random(seed)
    inputs = synthetic_inputs(40, (4, 8), seed=seed, now=datetime(2026, 11, 29, tzinfo=UTC))
    squeue = squeue_text(inputs.jobs, slurm_output("squeue-jobs.txt")).splitlines()
    sinfo = sinfo_text(inputs.nodes, slurm_output("sinfo-nodes.txt")).splitlines()
    details = parse_job_details(
        scontrol_jobs_text(inputs.jobs, slurm_output("scontrol-show-job.txt"))
    )
    jobs_reader, nodes_reader = SqueueReader(), SinfoReader()
    last_jobs: dict[str, JobInfo] = {}
    last_nodes: dict[str, NodeInfo] = {}
    for _ in range(30):
        jobs_now, nodes_now = list(squeue), list(sinfo)
        for _ in range(rng.randint(0, 3)):
            _squeue_change(rng, jobs_now)
            _sinfo_change(rng, nodes_now)
        jobs_text = "".join(f"{line}\n" for line in jobs_now)
        nodes_text = "".join(f"{line}\n" for line in nodes_now)
        want = _read_or_error(lambda: SqueueReader().read(jobs_text, details))  # noqa: B023
        got = _read_or_error(lambda: jobs_reader.read(jobs_text, details))  # noqa: B023
        assert got == want
        if isinstance(got, tuple):
            for line, job in zip(jobs_now, got[0], strict=True):
                if job.raw_job_id not in got[1]:  # (one waiting for its detail is read again)
                    assert last_jobs.get(line, job) is job  # an unchanged line: the same job
            last_jobs = dict(zip(jobs_now, got[0], strict=True))
            squeue = jobs_now
        want = _read_or_error(lambda: parse_sinfo_text(nodes_text))  # noqa: B023
        got = _read_or_error(lambda: nodes_reader.read(nodes_text))  # noqa: B023
        assert got == want
        if isinstance(got, list):
            for node in got:
                assert last_nodes.get(repr(node), node) is node  # equal: the same object
            last_nodes = {repr(node): node for node in got}
            sinfo = nodes_now


def test_a_changed_line_of_the_same_run_keeps_its_gpu_detail(slurm_output: Output) -> None:
    inputs = synthetic_inputs(20, 4, seed=1, now=datetime(2026, 11, 29, tzinfo=UTC))
    lines = squeue_text(inputs.jobs, slurm_output("squeue-jobs.txt")).splitlines()
    details = parse_job_details(
        scontrol_jobs_text(inputs.jobs, slurm_output("scontrol-show-job.txt"))
    )
    reader = SqueueReader()
    first, _ = reader.read("".join(f"{line}\n" for line in lines), details)
    renamed, restarted = _fields(lines[0]), _fields(lines[1])
    renamed[15] = "renamed"
    restarted[12] = "1800000000"  # another run of the job: its detail is asked for again
    lines[0], lines[1] = SEP.join(renamed), SEP.join(restarted)
    jobs, missing = reader.read("".join(f"{line}\n" for line in lines))
    assert jobs[0].name == "renamed" and jobs[0].gres_detail == first[0].gres_detail != ()
    assert missing == [first[1].raw_job_id] and jobs[1].gres_detail == ()
    assert all(a is b for a, b in zip(first[2:], jobs[2:], strict=True))
    again, missing = reader.read("".join(f"{line}\n" for line in lines), details)
    assert missing == [] and again[1].gres_detail == first[1].gres_detail
    assert again[0] is jobs[0] and again[1] is not jobs[1]


def test_a_refused_listing_leaves_the_reader_as_it_was(slurm_output: Output) -> None:
    inputs = synthetic_inputs(10, 4, seed=2, now=datetime(2026, 11, 29, tzinfo=UTC))
    text = squeue_text(inputs.jobs, slurm_output("squeue-jobs.txt"))
    details = parse_job_details(
        scontrol_jobs_text(inputs.jobs, slurm_output("scontrol-show-job.txt"))
    )
    reader = SqueueReader()
    first, _ = reader.read(text, details)
    lines = text.splitlines()
    forged = _fields(lines[0])
    forged[0] = forged[-1] = _fields(lines[1])[0]  # job 2's id in job 1's place: job 2 twice
    with pytest.raises(SlurmParseError, match="twice"):
        reader.read("".join(f"{line}\n" for line in [SEP.join(forged), *lines[1:]]))
    again, missing = reader.read(text)
    assert missing == [] and all(a is b for a, b in zip(first, again, strict=True))
    node_text = sinfo_text(inputs.nodes, slurm_output("sinfo-nodes.txt"))
    nodes_reader = SinfoReader()
    nodes = nodes_reader.read(node_text)
    with pytest.raises(SlurmParseError):
        nodes_reader.read(node_text.replace(f"{SEP}gpu{SEP}", f"{SEP}{SEP}", 1))
    assert all(a is b for a, b in zip(nodes, nodes_reader.read(node_text), strict=True))
