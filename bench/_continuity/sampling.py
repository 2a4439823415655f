"""What is sampled while a scenario runs, on the cluster side: the broker's routes and replicas
(and, once armed, a TCP connect to the victim's endpoint) every POLL_S, this state directory's
jobs in squeue every JOB_POLL_S, and the look-ups the faults need: a process's children and
the client connections it holds (/proc), a job's state (squeue), a node's state (sinfo), the
routes a proxy worker holds (GET /health), and the moment a condition first held.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Self

from .figures import Sample
from .params import JOB_POLL_S, POLL_S


class _Periodic:
    """A daemon thread that calls ``tick`` every ``every_s`` (start to start) until ``stop``,
    which waits up to ``join_s`` for it to end."""

    every_s: float
    join_s: float

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_s)

    def tick(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.tick()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began)))


class Poller(_Periodic):
    """Every POLL_S, the broker's routes and replicas for one model (GET /v1/routes, GET
    /v1/replicas?all=1, as `xhpc ps --all --json`), and, once armed, a TCP connect to one
    endpoint (the first failed connect after the fault)."""

    every_s = POLL_S
    join_s = 10.0

    def __init__(self, socket_path: Path, model: str) -> None:
        from xhpc.client.http import BrokerTransport

        self.client = BrokerTransport(socket_path, timeout_s=2.0)
        self.model = model
        self.samples: list[Sample] = []
        self.rows: list[dict[str, Any]] | None = None  # the latest answer
        self.job_ids: set[str] = set()
        self.replica_ids: set[str] = set()
        self.probe: tuple[str, int] | None = None
        self.probe_failed_at: float | None = None
        self._lock = threading.Lock()
        super().__init__()

    def latest(self) -> list[dict[str, Any]] | None:
        with self._lock:
            return self.rows

    def ready_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.latest() or () if r["state"] == "READY"]

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def arm_probe(self, host: str, port: int) -> None:
        self.probe = (host, port)

    def tick(self) -> None:
        from xhpc.errors import XhpcError

        routed: frozenset[str] | None = None
        rows: list[dict[str, Any]] | None = None
        t: float | None = None  # when the routes answered
        try:
            table = self.client.get("/v1/routes")
            t = time.monotonic()
            routed = frozenset(
                r["replica_id"] for r in table.get("routes", ()) if r["model"] == self.model
            )
            every = self.client.get("/v1/replicas?all=1")
            rows = [r for r in every if r["deployment"] == self.model]
        except (XhpcError, OSError, ValueError, KeyError, TypeError, AttributeError):
            t = t if routed is not None else time.monotonic()
        if t is None:
            t = time.monotonic()
        with self._lock:
            ready = None if rows is None else sum(r["state"] == "READY" for r in rows)
            self.samples.append(Sample(t, routed, ready))
            if rows is not None:
                self.rows = rows
                self.replica_ids.update(r["replica_id"] for r in rows)
                self.job_ids.update(str(r["job_id"]) for r in rows if r.get("job_id"))
        if self.probe is not None and self.probe_failed_at is None:
            self._probe_once(self.probe)

    def _probe_once(self, address: tuple[str, int]) -> None:
        at = time.monotonic()
        try:
            with socket.create_connection(address, timeout=0.3):
                pass
        except OSError:
            self.probe_failed_at = at


LIVE_JOB_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING"}
)


class JobPoller(_Periodic):
    """Every JOB_POLL_S, this state directory's jobs in squeue (by their output path): every job
    id seen, and the peak of live jobs beyond one per replica (by the job's tag, `--comment`
    ``xhpc:BROKER:DEPLOYMENT:REPLICA``)."""

    every_s = JOB_POLL_S
    join_s = 30.0

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = str(state_dir)
        self.job_ids: set[str] = set()
        self.duplicates_peak = 0
        self.duplicates_seen: dict[str, list[str]] = {}
        super().__init__()

    def tick(self) -> None:
        from tests.conftest import slurm_env

        try:
            out = subprocess.run(
                ["squeue", "-h", "-o", "%i|%T|%o|%k"], env=slurm_env(), check=True,
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return  # slurmctld down: nothing learnt this time
        per: dict[str, list[str]] = {}
        for line in out.splitlines():
            parts = line.split("|", 3)
            if len(parts) < 4 or self.state_dir not in parts[2]:
                continue
            job, state, _, comment = parts
            self.job_ids.add(job)
            tag = comment.split(":")
            if len(tag) == 4 and tag[0] == "xhpc" and state in LIVE_JOB_STATES:
                per.setdefault(tag[3], []).append(job)
        dups = {k: v for k, v in per.items() if len(v) > 1}
        n = sum(len(v) - 1 for v in dups.values())
        if n > self.duplicates_peak:
            self.duplicates_peak, self.duplicates_seen = n, dups


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, from /proc/PID/stat."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0], int(fields[1])


def child_pids(parent: int) -> list[int]:
    """Live (not zombie) children of ``parent``: the proxy supervisor's workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat[1] == parent and stat[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


def client_connections(pid: int, port: int) -> int:
    """Established TCP connections on local port ``port`` that process ``pid`` holds (the
    clients a proxy worker accepted and has not closed)."""
    inodes: set[str] = set()
    fd_dir = Path("/proc") / str(pid) / "fd"
    try:
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    except OSError:
        return 0
    held = 0
    for table in ("tcp", "tcp6"):
        try:
            text = (Path("/proc") / str(pid) / "net" / table).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "01":  # 01: ESTABLISHED
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                held += 1
    return held


def own_children_reaped(xhpc_bin: str) -> None:
    """After a failed start (no Xhpc to tear down): stop the xhpc processes this process started."""
    for pid in child_pids(os.getpid()):
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if xhpc_bin.encode() in cmd[:2]:  # [XHPC, ...] or [python, XHPC, ...]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def job_state(job: str) -> str | None:
    """The job's state in squeue ("" once it left squeue; None when squeue did not answer)."""
    from tests.conftest import slurm_env

    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_env(), capture_output=True,
            text=True, timeout=10,
        )  # fmt: skip
    except subprocess.SubprocessError:
        return None
    if proc.returncode != 0:  # squeue fails for a job id it no longer knows, too
        return "" if "Invalid job id" in proc.stderr else None
    return proc.stdout.strip()


def proxy_routes(port: int) -> int:
    """How many routes the proxy worker that answers holds (GET /health); -1: no answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read()
        return int(json.loads(body)["routes"]) if resp.status == 200 else -1
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return -1
    finally:
        conn.close()


def job_submit_epoch(job: str) -> float | None:
    """When Slurm accepted the job (``SubmitTime``, the controller's local time), as an epoch."""
    from tests.conftest import slurm_env

    proc = subprocess.run(
        ["scontrol", "-o", "show", "job", job], env=slurm_env(), capture_output=True,
        text=True, timeout=10,
    )  # fmt: skip
    for word in proc.stdout.split():
        if word.startswith("SubmitTime="):
            with contextlib.suppress(ValueError):
                return datetime.strptime(word.partition("=")[2], "%Y-%m-%dT%H:%M:%S").timestamp()
    return None


def node_state(node: str) -> str:
    from tests.conftest import slurm_env

    proc = subprocess.run(
        ["sinfo", "-h", "-n", node, "-o", "%T"], env=slurm_env(), capture_output=True,
        text=True, timeout=10,
    )  # fmt: skip
    return proc.stdout.strip()


def when(predicate: Callable[[], object], timeout_s: float, what: str, step_s: float) -> float:
    """The monotonic time at which ``predicate`` was first seen true (polled every ``step_s``,
    failing after ``timeout_s``: the chaos suite's ``wait_for``)."""
    from tests.conftest import wait_for

    at = wait_for(lambda: bool(predicate()) and time.monotonic(), timeout_s, what, step_s)
    assert isinstance(at, float)
    return at
