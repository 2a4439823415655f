"""The GPU detail of jobs from ``scontrol -d -o show job`` (pure).

``squeue -O`` cannot print which GPU indexes a job holds on each node (``gres_detail`` of
``squeue --json``); ``scontrol --details --oneliner show job [ID]`` can, one line per job:
``JobId=8 JobName=... JOB_GRES=gpu:2 Nodes=n[1-2] CPU_IDs=0-1 Mem=0 GRES=gpu:1(IDX:0) ...``
(nodes with equal allocations are one group). The name and comment in that line are user
text, so a line is read only if it starts with ``JobId=`` and holds ``JOB_GRES=`` once, and no job
is listed twice; anything else is a :class:`SlurmParseError`.
"""

from __future__ import annotations

import re

from xhpc.errors import SlurmParseError
from xhpc.placement.hostlist import expand_hostlist

_LINE = re.compile(r"JobId=(\d+) ")
_GROUPS = re.compile(r" JOB_GRES=\S*((?: +Nodes=\S+ CPU_IDs=\S* Mem=\d+ GRES=\S*)+)")
_GROUP = re.compile(r"Nodes=(\S+) CPU_IDs=\S* Mem=\d+ GRES=(\S*)")


def parse_job_details(text: str) -> dict[int, tuple[str, ...]]:
    """``scontrol -d -o show job`` -> job id -> its GPU detail per allocated node, in node order
    (as ``gres_detail`` of ``squeue --json``; () for a job with no allocation or no GRES)."""
    out: dict[int, tuple[str, ...]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise SlurmParseError(f"scontrol show job: not a job line: {line[:200]!r}")
        job_id = int(m.group(1))
        if job_id in out:
            raise SlurmParseError(f"scontrol show job: job {job_id} twice")
        count = line.count(" JOB_GRES=")
        if count > 1:
            raise SlurmParseError(f"scontrol show job: job {job_id}: JOB_GRES= {count} times")
        groups = _GROUPS.search(line) if count else None
        detail: list[str] = []
        if groups is not None:
            for nodes, gres in _GROUP.findall(groups.group(1)):
                detail.extend([gres] * len(expand_hostlist(nodes)))
        out[job_id] = tuple(detail) if any(detail) else ()
    return out
