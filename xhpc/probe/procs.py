"""Which Slurm job a process belongs to, read from /proc (or a fake proc root in tests).

A GPU process is found in a job by, in order: ``SLURM_JOB_ID`` in its environment or in one of its
ancestors' (an engine is a child of the job's agent, and may have been started with a scrubbed
environment), then the ``job_<id>`` component of its cgroup (Slurm's cgroup plugins place every task
under ``.../job_<id>/step_<n>/``; the cgroup file is readable by everyone, unlike ``environ``).
A process found in no job is a *foreign* process: GPU memory held outside Slurm (an orphan).

The id is the one Slurm gives the running job: for array tasks and heterogeneous components that is
the raw job id (e.g. ``124``), not ``123_4`` or ``123+1``.
"""

from __future__ import annotations

import re
from pathlib import Path

PROC = Path("/proc")
JOB_ENV = "SLURM_JOB_ID"
_CGROUP_JOB = re.compile(r"/job_(\d+)(?:/|$)")


def read_environ(pid: int, proc_root: Path = PROC) -> dict[str, str] | None:
    """The environment a process started with; None when it is gone or not ours to read."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def parent_pid(pid: int, proc_root: Path = PROC) -> int | None:
    """The parent's pid from ``/proc/<pid>/stat``; None when unknown."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ')'.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 2 or not fields[1].isdigit():
        return None
    return int(fields[1])


def cgroup_job(pid: int, proc_root: Path = PROC) -> str | None:
    """The job id in a process's Slurm cgroup path, if it has one."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        match = _CGROUP_JOB.search(line.rpartition(":")[2])
        if match:
            return match.group(1)
    return None


def _valid_job(value: str | None) -> str | None:
    value = (value or "").strip()
    return value if value.isdigit() else None


def job_of_pid(pid: int, proc_root: Path = PROC, max_depth: int = 4) -> str | None:
    """The Slurm job ``pid`` runs in, looking up to ``max_depth`` ancestors; None: foreign."""
    current: int | None = pid
    for _ in range(max_depth + 1):
        if current is None or current <= 1:
            break
        env = read_environ(current, proc_root)
        job = _valid_job(env.get(JOB_ENV) if env else None)
        if job is not None:
            return job
        current = parent_pid(current, proc_root)
    return cgroup_job(pid, proc_root)
