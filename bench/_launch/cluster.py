"""The dev cluster as the launch benchmarks see it (bench/launch.py, bench/submit_to_ready.py):
the SLURM_CONF every Slurm command gets, a job's row in squeue (by id or by name), the nodes'
addresses (sinfo), cancelling jobs by id and waiting for them to leave squeue, and whether a
server answers a one-token chat completion with HTTP 200.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SLURM_CONF = Path(os.environ.get("XHPC_DEV_DIR", "/tmp/xhpc-dev-cluster")) / "etc" / "slurm.conf"
SQUEUE_FORMAT = "%i|%j|%T|%N"  # id, name, state (long form), nodes
SLURM_TIMEOUT_S = 10.0


def slurm_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the dev cluster's SLURM_CONF."""
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(SLURM_CONF)
    return env


@dataclass(frozen=True)
class JobRow:
    """A job as squeue shows it; ``node`` is empty while it is pending."""

    job_id: str
    name: str
    state: str
    node: str


def parse_rows(text: str) -> list[JobRow]:
    """squeue's ``-h -o SQUEUE_FORMAT`` lines as rows (a name may not hold ``|``)."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            rows.append(JobRow(*parts))
    return rows


def job_rows(*, job_id: str | None = None, names: Iterable[str] = ()) -> list[JobRow] | None:
    """The jobs in squeue with this id and/or one of these names; None when squeue did not
    answer. A job id that squeue no longer knows is no row (squeue fails for it)."""
    argv = ["squeue", "-h", "-o", SQUEUE_FORMAT]
    if job_id is not None:
        argv += ["-j", job_id]
    wanted = ",".join(names)
    if wanted:
        argv += ["-n", wanted]
    try:
        proc = subprocess.run(
            argv, env=slurm_env(), capture_output=True, text=True, timeout=SLURM_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return [] if "Invalid job id" in proc.stderr else None
    return parse_rows(proc.stdout)


def job_row(job_id: str) -> JobRow | None:
    """The job's row, or None once it left squeue (or squeue did not answer)."""
    rows = job_rows(job_id=job_id)
    return rows[0] if rows else None


def parse_addresses(text: str) -> dict[str, str]:
    """sinfo's ``-h -N -o %N|%o`` lines (a node once per partition) as node -> address."""
    out = {}
    for line in text.splitlines():
        name, sep, address = line.strip().partition("|")
        if sep and name and address:
            out[name] = address
    return out


def node_addresses() -> dict[str, str]:
    """Every node's address (NodeAddr): the dev nodes' names do not resolve on the login side."""
    proc = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N|%o"], env=slurm_env(), capture_output=True, text=True,
        timeout=SLURM_TIMEOUT_S, check=True,
    )  # fmt: skip
    return parse_addresses(proc.stdout)


def node_address(node: str) -> str:
    return node_addresses()[node]


def scancel(job_ids: Iterable[str]) -> None:
    """Cancel these jobs (ours, by id); an id Slurm no longer knows is fine."""
    ids = sorted(set(job_ids))
    if ids:
        subprocess.run(
            ["scancel", *ids], env=slurm_env(), capture_output=True, timeout=SLURM_TIMEOUT_S,
            check=False,
        )  # fmt: skip


def wait_gone(names: Iterable[str], timeout_s: float, step_s: float = 0.5) -> list[str]:
    """Wait until no job of these names is in squeue; the ids still there after ``timeout_s``
    (empty: all gone)."""
    wanted = list(names)
    deadline = time.monotonic() + timeout_s
    while True:
        rows = job_rows(names=wanted) if wanted else []
        if rows is not None and not rows:
            return []
        if time.monotonic() > deadline:
            return [r.job_id for r in rows or []]
        time.sleep(step_s)


def chat_ok(host: str, port: int, model: str, timeout_s: float = 10.0) -> bool:
    """Does POST /v1/chat/completions (one user message, ``max_tokens`` 1) answer 200?"""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
