"""Slurm accounting (`sacct`) of the jobs xhpc submitted: their GPUs and run time (pure).

Asked as ``sacct --allocations --duplicates --noheader --parsable2 --user=U --jobs=IDS
--format=JobID,User,Account,Submit,ElapsedRaw,AllocTRES,State`` with ``SLURM_TIME_FORMAT=%s``
(Submit in Unix seconds, whatever the time zone). ``--allocations``: one record per job (a
hetjob: one per component, ``LEADER+OFFSET``), not per step; ``--duplicates``: every run of a
requeued job, and any older job that had the same id (xhpc keeps the records submitted since it
submitted the job). Job ids are asked in batches, so that no argv grows with the runs recorded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime

from xhpc.access import JobUsage
from xhpc.errors import SlurmParseError

SACCT_FIELDS = ("JobID", "User", "Account", "Submit", "ElapsedRaw", "AllocTRES", "State")
SACCT_TIME_FORMAT = "%s"  # SLURM_TIME_FORMAT for the call
SACCT_BATCH = 200  # job ids per sacct call: a few KiB of argv
MAX_ELAPSED_S = 10 * 366 * 86400  # a record that claims more is not believed

_JOB_ID = re.compile(r"\d{1,12}(\+\d{1,4})?")
_NUMBER = re.compile(r"\d{1,12}")
_STATE = re.compile(r"[A-Z_]{1,32}")
_NAME = re.compile(r"[^\x00-\x20|]{0,128}")  # a user or account: no blanks


def batches(job_ids: Sequence[str], size: int = SACCT_BATCH) -> list[list[str]]:
    """``job_ids`` (each once, in order) in lists of at most ``size``."""
    unique = list(dict.fromkeys(job_ids))
    return [unique[i : i + size] for i in range(0, len(unique), size)]


def alloc_gpus(tres: str) -> int | None:
    """The ``gres/gpu`` count of an AllocTRES string (``billing=2,cpu=2,gres/gpu=2,...``); the
    typed counts (``gres/gpu:a100=2``) repeat it and are not added. None when it names none
    (a job that has not started, or GPUs Slurm does not track)."""
    for item in tres.split(","):
        key, sep, value = item.partition("=")
        if sep and key == "gres/gpu":
            if not _NUMBER.fullmatch(value):
                raise SlurmParseError(f"sacct AllocTRES has gres/gpu={value!r}", stdout=tres)
            return int(value)
    return None


def _line(line: str) -> JobUsage:
    fields = line.split("|")
    if len(fields) != len(SACCT_FIELDS):
        raise SlurmParseError(
            f"sacct line has {len(fields)} fields, not {len(SACCT_FIELDS)}: {line[:200]!r}"
        )
    job_id, user, account, submit, elapsed, tres, state = fields
    words = state.split()
    checks = (
        (_JOB_ID, job_id, "JobID"),
        (_NAME, user, "User"),
        (_NAME, account, "Account"),
        (_NUMBER, submit, "Submit (SLURM_TIME_FORMAT=%s)"),
        (_NUMBER, elapsed, "ElapsedRaw"),
        (_STATE, words[0] if words else "", "State"),
    )
    for pattern, value, name in checks:
        if not pattern.fullmatch(value):
            raise SlurmParseError(f"sacct {name} {value[:80]!r} in line {line[:200]!r}")
    if int(elapsed) > MAX_ELAPSED_S:
        raise SlurmParseError(f"sacct ElapsedRaw {elapsed} in line {line[:200]!r}")
    return JobUsage(
        job_id=job_id,
        user=user,
        account=account or None,
        submitted_at=datetime.fromtimestamp(int(submit), UTC),
        elapsed_s=int(elapsed),
        gpus=alloc_gpus(tres) if tres else None,
        state=words[0],
    )


def parse_sacct_usage(text: str) -> list[JobUsage]:
    """The records of `sacct --noheader --parsable2 --format=` SACCT_FIELDS, in sacct's order;
    a line that is not exactly that is an error (nothing is guessed)."""
    return [_line(line) for line in text.splitlines() if line.strip()]
