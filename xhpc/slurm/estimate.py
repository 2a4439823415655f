"""`sbatch --test-only`'s answer (pure): when and where Slurm expects a job to start.

sbatch reports on stderr, through its ``info()`` (prefix ``sbatch: ``), one line

    sbatch: Job 12 to start at 1764629646 using 2 processors on nodes n2 in partition gpu

with the time as ``SLURM_TIME_FORMAT`` says (the client sets ``%s``: seconds since the epoch,
no time zone to guess); a time in Slurm's default ``YYYY-MM-DDTHH:MM:SS`` (local time) is read
too. A job the cluster can never run fails instead (exit 1, ``sbatch: error: ...``): the client
raises SlurmError then, and nothing here is called.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from xhpc.errors import SlurmParseError
from xhpc.models import StartEstimate

# SLURM_TIME_FORMAT for the call: the start as seconds since the epoch
TEST_ONLY_TIME_FORMAT = "%s"

_LINE = re.compile(
    r"^(?:sbatch: )?Job (?P<job>\d+) to start at (?P<at>\S+) using (?P<procs>\d+) "
    r"processors on nodes (?P<nodes>\S+)(?: in partition (?P<part>\S+))?\s*$"
)
MAX_LINE = 4096  # a longer line is not sbatch's


def _when(text: str) -> datetime:
    if text.isdigit():
        return datetime.fromtimestamp(int(text), UTC)
    try:
        at = datetime.fromisoformat(text)
    except ValueError as err:
        raise SlurmParseError(f"sbatch --test-only: unreadable start time {text[:40]!r}") from err
    # Slurm's default format is the controller host's local time, without a zone.
    return (at if at.tzinfo else at.astimezone()).astimezone(UTC)


def parse_test_only(stderr: str) -> StartEstimate:
    """The estimate in sbatch's ``--test-only`` output (its stderr; other lines, such as a
    job_submit plugin's message, are skipped). SlurmParseError when no line says when."""
    for line in stderr.splitlines():
        if len(line) > MAX_LINE:
            continue
        m = _LINE.match(line.strip())
        if m is None:
            continue
        return StartEstimate(
            start=_when(m["at"]),
            partition=m["part"],
            nodes=m["nodes"],
            processors=int(m["procs"]),
        )
    first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "")
    raise SlurmParseError(
        f"sbatch --test-only gave no start estimate: {first[:200]!r}"
        if first
        else "sbatch --test-only gave no start estimate (no output)"
    )
