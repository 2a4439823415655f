"""Slurm accounting of xhpc's jobs: `sacct` records parsed strictly (tests/data/slurm/
sacct-usage.txt; the odd lines below are hand-written and say so), asked in batches of job ids
with Submit in Unix seconds, and read as GPUs times seconds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from xhpc.access import JobUsage
from xhpc.errors import SlurmError, SlurmParseError
from xhpc.settings import SlurmConfig
from xhpc.slurm import argv as A
from xhpc.slurm.client import CliSlurmClient
from xhpc.slurm.sacct import SACCT_FIELDS, alloc_gpus, batches, parse_sacct_usage

Output = Callable[[str], str]
LINE = "9|root|lab1|1764415800|60|billing=1,cpu=1,gres/gpu=1,node=1|COMPLETED"


def test_records_of_plain_het_pending_and_requeued_jobs(slurm_output: Output) -> None:
    records = parse_sacct_usage(slurm_output("sacct-usage.txt"))
    assert [(r.job_id, r.leader, r.account, r.gpus, r.elapsed_s, r.state) for r in records] == [
        ("1", "1", "lab1", 2, 3725, "COMPLETED"),
        ("2", "2", "lab1", 1, 61, "CANCELLED"),  # "CANCELLED by 0": its first word
        ("3+0", "3", "lab1", 1, 120, "CANCELLED"),
        ("3+1", "3", "lab1", 1, 120, "CANCELLED"),
        ("6", "6", "lab2", None, 0, "PENDING"),
        ("8", "8", "lab1", 1, 300, "REQUEUED"),
        ("8", "8", "lab1", 1, 42, "RUNNING"),
    ]
    assert {r.user for r in records} == {"root"}
    assert records[0].submitted_at == datetime(2025, 11, 29, 11, 30, tzinfo=UTC)
    assert [r.gpu_seconds for r in records] == [7450, 61, 120, 120, 0, 300, 42]
    assert [r.ended for r in records] == [True, True, True, True, False, False, False]


def test_only_the_untyped_gpu_count_of_alloc_tres_is_read() -> None:
    assert alloc_gpus("billing=4,cpu=4,gres/gpu=2,mem=16G,node=1") == 2
    # hand-written: a site that tracks GPU types lists the typed count beside the total
    assert alloc_gpus("cpu=8,gres/gpu:a100=2,gres/gpu=2,node=1") == 2
    assert alloc_gpus("billing=1,cpu=1,mem=1000M,node=1") is None  # GPUs not tracked
    with pytest.raises(SlurmParseError, match="gres/gpu='two'"):
        alloc_gpus("cpu=1,gres/gpu=two")


def test_a_job_that_ran_with_untracked_gpus_has_no_figure() -> None:
    (record,) = parse_sacct_usage(LINE.replace("gres/gpu=1,", ""))
    assert record.gpus is None and record.gpu_seconds is None  # unknown, not 0
    (pending,) = parse_sacct_usage("9|root|lab1|1764415800|0||PENDING\n")
    assert pending.gpu_seconds == 0  # it never ran: nothing was used


@pytest.mark.parametrize(
    "line",
    [
        LINE + "|extra",  # a field too many
        LINE.rsplit("|", 1)[0],  # one too few
        LINE.replace("1764415800", "2025-11-29T12:30:00"),  # SLURM_TIME_FORMAT not honoured
        LINE.replace("|60|", "|1:00|"),  # Elapsed, not ElapsedRaw
        LINE.replace("|60|", f"|{11 * 366 * 86400}|"),  # more than a run can last
        LINE.replace("9|", "9_0|", 1),  # an array task: xhpc submits none
        LINE.replace("9|", "9'; echo foo|", 1),  # hostile
        LINE.replace("COMPLETED", "completed"),
        LINE.replace("COMPLETED", ""),
        LINE.replace("lab1", "lab 1"),
        LINE.replace("gres/gpu=1", "gres/gpu=-1"),
    ],
)
def test_a_line_that_is_not_exactly_the_format_is_an_error(line: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sacct_usage(line + "\n")


def test_blank_lines_are_skipped_and_an_empty_account_is_none() -> None:
    (record,) = parse_sacct_usage("\n" + LINE.replace("lab1", "") + "\n\n")
    assert record.account is None


def test_the_argv_asks_for_allocations_of_one_user_and_every_run() -> None:
    assert A.sacct_usage(["1", "2+0"], "root", SACCT_FIELDS, Path("/opt/slurm/bin")) == [
        "/opt/slurm/bin/sacct",
        "--allocations",
        "--duplicates",
        "--noheader",
        "--parsable2",
        "--user=root",
        "--jobs=1,2+0",
        "--format=JobID,User,Account,Submit,ElapsedRaw,AllocTRES,State",
    ]


def test_batches_hold_each_id_once() -> None:
    ids = [str(i) for i in range(450)]
    got = batches([*ids, "7", "8"], size=200)
    assert [len(b) for b in got] == [200, 200, 50]
    assert [i for b in got for i in b] == ids
    assert batches([]) == []


def _fake_sacct(tmp_path: Path, rc: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sacct"
    script.write_text(
        f"#!/bin/sh\necho \"$SLURM_TIME_FORMAT $*\" >> {tmp_path}/calls\necho '{LINE}'\nexit {rc}\n"
    )
    script.chmod(0o755)
    return bin_dir


def test_the_client_asks_in_batches_with_unix_times(tmp_path: Path) -> None:
    client = CliSlurmClient(SlurmConfig(bin_dir=_fake_sacct(tmp_path)))
    ids = [str(i) for i in range(1, 451)]
    records = asyncio.run(client.job_usage(ids, "root"))
    assert records == [parse_sacct_usage(LINE)[0]] * 3
    assert isinstance(records[0], JobUsage)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3
    for call, batch in zip(calls, batches(ids), strict=True):
        words = call.split()
        assert words[0] == "%s" and "--user=root" in words
        assert f"--jobs={','.join(batch)}" in words


def test_a_failing_sacct_is_a_slurm_error(tmp_path: Path) -> None:
    client = CliSlurmClient(SlurmConfig(bin_dir=_fake_sacct(tmp_path, rc=1)))
    with pytest.raises(SlurmError) as info:
        asyncio.run(client.job_usage(["1"], "root"))
    assert info.value.returncode == 1
