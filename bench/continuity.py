"""Continuity under faults: one row per fault of a cluster's ordinary life, as users see it.

The chaos suite's faults (tests/cluster/test_chaos.py), measured instead of asserted. Each
scenario runs on the real dev cluster (`scripts/dev-cluster up`) with the tiny model and the
transformers engine, with a broker and a proxy of its own (own state dir and port:
tests/conftest.py's ``own_xhpc``, with the chaos suite's ``[lifecycle] backoff_s = 1,
lost_grace_s = 20``); it serves 2 replicas (the chaos suite's ``serve``), runs steady traffic
through `xhpc proxy` with every answer checked (tests/cluster/traffic.py: 2 threads back to back,
plain and streamed requests alternately), injects its fault, waits for the outcome (deadlines,
never fixed sleeps), stops the model (`xhpc stop`), counts the jobs left, and tears everything
down (broker, proxy, leftover jobs; a failed node, slurmctld, an urgent job) even when it fails.

Scenarios (``--only`` names):

    engine-kill        the engine of replica 0 killed with SIGKILL
    requeue            `scontrol requeue` of replica 0's job
    proxy-worker-kill  kill -9 of the `xhpc proxy` worker holding the most client connections
                       (the workers are the supervisor's children, found through /proc)
    proxy-reload       SIGHUP to the proxy's supervisor (fresh workers, the old ones drain)
    broker-kill        the broker killed with SIGKILL, down ``--broker-down-s`` (30; 300 for the
                       "5 minutes" figure), started again, watched past its restart grace
    preemption         an `urgent`-partition job taking replica 0's node (PreemptMode=REQUEUE)
    node-loss          `scripts/dev-cluster node-fail K` on replica 0's node (`node-up K` after)
    ctld-outage        slurmctld stopped for 60 s (`ctld-stop`, `ctld-start`)
    walltime           one replica in 3-minute jobs, `[lifecycle] handover_floor_s = 120`: two
                       walltime handovers under traffic
    crash-loop         the chaos suite's crash loop: the `command` engine running
                       tests/data/engines/echo_engine.py, which crashes on every start once the
                       first replica is killed. No traffic: the echo engine's answers are not
                       the tiny model's, and the traffic's checks would call them truncated

Columns (times in s from the fault: the moment just before the signal, command or sbatch that
injects it; the broker is sampled every 0.2 s: GET /v1/routes, and GET /v1/replicas?all=1, what
`xhpc ps --all --json` reads):

    requests plain / stream  requests sent through the proxy during the scenario, by kind
    failed plain / stream    of those, the ones that failed (anything but a whole answer)
    truncated 200s           200s cut short without an error event (no fault may cause one)
    out of rotation          fault -> the first sample of the broker's routing table without
                             the affected replica (the proxy's workers follow within one
                             `[proxy] refresh_interval_s`); "—": the fault hits no replica
    capacity restored        fault -> the first sample with as many READY replicas as at the
                             fault, after one with fewer; "no drop": never fewer
    extra jobs               Slurm jobs seen (in `xhpc ps --all` rows, and in squeue for this
                             state directory every 1 s) beyond what the scenario needs: one per
                             replica served, one more for a replacement or a move, one per
                             walltime successor, one per crash-loop attempt
    leaked jobs              jobs of this state directory still in squeue 90 s after `xhpc stop`

    .venv/bin/python bench/continuity.py [--short] [--only NAME[,NAME]] [--broker-down-s S]
                                         [--json FILE] [--keep]

Expect ~25 min for all ten (+4.5 with ``--broker-down-s 300``); ``--short`` (engine-kill and
requeue) ~5 min. Needs the dev cluster up, root (node-fail, ctld-stop), .venvs/transformers and
models/tiny-llama (made if missing). Exit status 0 when every scenario ran to its end (targets met
or not), 1 when one could not (its row says why; the logs are kept), 128 + the signal's number
when interrupted (SIGTERM or ^C: the scenario under way is torn down, the table printed).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from tests.cluster.traffic import Outcome, Traffic
    from tests.conftest import Xhpc

MODEL_DIR = ROOT / "models" / "tiny-llama"
TRANSFORMERS_PY = ROOT / ".venvs" / "transformers" / "bin" / "python"

POLL_S = 0.2  # the broker's routes and replicas
JOB_POLL_S = 1.0  # squeue, for this state directory's jobs
CTLD_DOWN_S = 60.0
BROKER_DOWN_S = 30.0
# After a broker restart, heartbeats are judged only after heartbeat_timeout_s (15 s on the dev
# cluster) + lifecycle.restart_grace_s (30 s): watch past that, with a margin.
BROKER_SETTLE_S = 60.0
LEAK_WAIT_S = 90.0
TARGET_NODE_ROTATION_S = 5.0
TARGET_CRASH_ATTEMPTS = 3
WALLTIME_HANDOVERS = 2

# name, row label, replicas served, jobs the scenario needs beyond one per replica served
SCENARIOS: tuple[tuple[str, str], ...] = (
    ("engine-kill", "engine SIGKILL"),
    ("requeue", "scontrol requeue"),
    ("proxy-worker-kill", "proxy worker kill -9"),
    ("proxy-reload", "proxy reload (SIGHUP)"),
    ("broker-kill", "broker kill -9, down"),
    ("preemption", "preemption (urgent job)"),
    ("node-loss", "node loss (node-fail)"),
    ("ctld-outage", "slurmctld down 60 s"),
    ("walltime", "walltime boundary x2"),
    ("crash-loop", "crash loop"),
)
NAMES = tuple(n for n, _ in SCENARIOS)
LABELS = dict(SCENARIOS)
SHORT = ("engine-kill", "requeue")
NO_TRAFFIC = frozenset({"crash-loop"})


def log(msg: str) -> None:
    print(f"[bench/continuity] {msg}", file=sys.stderr, flush=True)


# --- pure: samples -> figures ------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One poll of the broker: ``routed`` the model's replicas in the routing table, ``ready``
    its READY replicas; None when the broker did not answer."""

    t: float  # monotonic
    routed: frozenset[str] | None
    ready: int | None


def out_of_rotation(samples: Sequence[Sample], victim: str, fault: float) -> float | None:
    """Fault -> the first sample at or after it whose routing table lacks ``victim``."""
    for s in samples:
        if s.t >= fault and s.routed is not None and victim not in s.routed:
            return s.t - fault
    return None


def restored(samples: Sequence[Sample], before: int, fault: float) -> tuple[bool, float | None]:
    """(whether the READY count fell below ``before`` after the fault, fault -> the first sample
    with ``before`` READY again after that fall; None if it did not come back)."""
    dropped = False
    for s in samples:
        if s.t < fault or s.ready is None:
            continue
        if not dropped and s.ready < before:
            dropped = True
        elif dropped and s.ready >= before:
            return True, s.t - fault
    return dropped, None


def route_gap(samples: Sequence[Sample], since: float) -> float:
    """The longest stretch (between samples) during which the model had no route at all."""
    longest = 0.0
    empty_since: float | None = None
    for s in samples:
        if s.t < since or s.routed is None:
            continue
        if not s.routed:
            empty_since = s.t if empty_since is None else empty_since
            longest = max(longest, s.t - empty_since)
        else:
            if empty_since is not None:
                longest = max(longest, s.t - empty_since)
            empty_since = None
    return longest


_FAILED_CONNECT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \w+ "
    r"(?:replica (\S+) unreachable: (\w*Connect\w*)|connecting to replica (\S+) timed out)"
)


def first_failed_connect(proxy_log: str, replica: str, since_epoch: float) -> float | None:
    """The wall time (epoch) of the proxy's first failed connection to ``replica`` at or after
    ``since_epoch``, from its log lines (``replica R unreachable: ...Connect...``, ``connecting to
    replica R timed out``; local time, ms)."""
    for line in proxy_log.splitlines():
        m = _FAILED_CONNECT.match(line)
        if not m or replica not in (m.group(2), m.group(4)):
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= since_epoch - 0.0005:  # the log has ms
            return at
    return None


def traffic_figures(outcomes: Sequence[Outcome], fault: float | None) -> dict[str, Any]:
    plain = [o for o in outcomes if not o.stream]
    streams = [o for o in outcomes if o.stream]
    bad = [o for o in outcomes if not o.ok]
    ref = fault if fault is not None else (outcomes[0].at if outcomes else 0.0)
    return {
        "sent": {"plain": len(plain), "stream": len(streams)},
        "failed": {"plain": sum(not o.ok for o in plain), "stream": sum(not o.ok for o in streams)},
        "truncated": sum(o.truncated for o in outcomes),
        "failures": [
            {
                "at_s": round(o.at - ref, 3),  # sent, relative to the fault
                "stream": o.stream,
                "status": o.status,
                "truncated": o.truncated,
                "detail": o.detail[:200],
            }
            for o in bad[:20]
        ],
    }


# --- pure: figures -> table and targets --------------------------------------------------------


def _s(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _failed_total(rec: dict[str, Any]) -> int | None:
    failed = rec.get("failed")
    return None if failed is None else int(failed["plain"]) + int(failed["stream"])


def _sent_total(rec: dict[str, Any]) -> int | None:
    sent = rec.get("sent")
    return None if sent is None else int(sent["plain"]) + int(sent["stream"])


def row(rec: dict[str, Any]) -> str:
    """One table row from one scenario's figures."""
    label = LABELS.get(rec["scenario"], rec["scenario"])
    if rec["scenario"] == "broker-kill" and rec.get("broker_down_s") is not None:
        label = f"{label} {rec['broker_down_s']:.0f} s"
    sent, failed = rec.get("sent"), rec.get("failed")
    if sent is None or failed is None:
        requests = fails = truncated = "—"
    else:
        requests = f"{sent['plain']} / {sent['stream']}"
        fails = f"{failed['plain']} / {failed['stream']}"
        truncated = str(rec.get("truncated", 0))
    if rec.get("victim") is None:
        rotation = "—"
    elif rec.get("out_of_rotation_s") is None:
        rotation = "never left"
    else:
        rotation = _s(rec["out_of_rotation_s"])
        extra = rec.get("out_of_rotation_after_connect_s")
        if extra is not None:
            rotation += f" ({extra:.1f} after the first failed connect)"
    if "dropped" not in rec:
        capacity = "—"
    elif not rec["dropped"]:
        capacity = "no drop"
    elif rec.get("restored_s") is None:
        capacity = "not restored"
    else:
        capacity = _s(rec["restored_s"])
    extra_jobs = "—" if rec.get("extra_jobs") is None else str(rec["extra_jobs"])
    leaked = "—" if rec.get("leaked_jobs") is None else str(rec["leaked_jobs"])
    notes = list(rec.get("notes") or [])
    if rec.get("error"):
        notes.insert(0, f"ERROR: {str(rec['error'])[:160]}")
    note = "; ".join(notes).replace("|", "/") or ""
    return (
        f"| {label} | {requests} | {fails} | {truncated} | {rotation} | {capacity} "
        f"| {extra_jobs} | {leaked} | {note} |"
    )


def _target(target: str, value: str, met: bool) -> dict[str, Any]:
    return {"target": target, "value": value, "met": bool(met)}


def evaluate_targets(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the scenarios that ran, each with its figure and whether it is met. A
    scenario that failed (``error``) meets none of its targets."""
    by = {r["scenario"]: r for r in records}
    out: list[dict[str, Any]] = []

    def err(rec: dict[str, Any]) -> str:
        return f"; scenario failed: {str(rec['error'])[:120]}" if rec.get("error") else ""

    if (r := by.get("walltime")) is not None:
        failed, sent = _failed_total(r), _sent_total(r)
        handovers = int(r.get("handovers") or 0)
        out.append(
            _target(
                f"walltime boundary: 0 failed requests, plain and stream "
                f"({WALLTIME_HANDOVERS} handovers)",
                f"{failed} of {sent} failed, {handovers} handovers{err(r)}",
                not r.get("error") and failed == 0 and handovers >= WALLTIME_HANDOVERS,
            )
        )
    if (r := by.get("proxy-worker-kill")) is not None:
        failed = _failed_total(r)
        held = r.get("in_flight_at_killed_worker")
        after = r.get("failed_after_kill")
        out.append(
            _target(
                "proxy worker kill -9: only the requests in flight at that worker fail",
                f"{failed} failed; the killed worker held {held} client connection(s); "
                f"{after} failed among those sent after the kill{err(r)}",
                not r.get("error")
                and failed is not None
                and held is not None
                and after == 0
                and failed <= held,
            )
        )
    if (r := by.get("proxy-reload")) is not None:
        failed, sent = _failed_total(r), _sent_total(r)
        out.append(
            _target(
                "proxy reload (SIGHUP): 0 failed requests",
                f"{failed} of {sent} failed{err(r)}",
                not r.get("error") and failed == 0,
            )
        )
    with_traffic = [r for r in records if r["scenario"] not in NO_TRAFFIC]
    if with_traffic:
        truncated = {r["scenario"]: int(r.get("truncated") or 0) for r in with_traffic}
        total = sum(truncated.values())
        where = ", ".join(f"{k} {v}" for k, v in truncated.items() if v)
        out.append(
            _target(
                "no truncated 200 in any scenario",
                f"{total} in {len(with_traffic)} scenario(s)" + (f" ({where})" if where else ""),
                total == 0,
            )
        )
    if (r := by.get("broker-kill")) is not None:
        failed = _failed_total(r)
        relaunches, dups = r.get("relaunches"), r.get("duplicate_jobs")
        out.append(
            _target(
                "broker kill -9 and outage: 0 failed, 0 relaunches, 0 duplicate jobs",
                f"down {_s(r.get('broker_down_s'), 0)} s: {failed} failed, {relaunches} "
                f"relaunches, {dups} duplicate jobs, {r.get('lost_transitions')} "
                f"transitions to LOST{err(r)}",
                not r.get("error") and failed == 0 and relaunches == 0 and dups == 0,
            )
        )
    if (r := by.get("requeue")) is not None:
        after = r.get("failed_after_left_running")
        out.append(
            _target(
                "requeue: 0 requests failed after the job left RUNNING",
                f"{after} failed of those sent after squeue showed the job leave RUNNING "
                f"(+{_s(r.get('left_running_s'))} s); {_failed_total(r)} failed in all{err(r)}",
                not r.get("error") and after == 0,
            )
        )
    if (r := by.get("node-loss")) is not None:
        rot = r.get("out_of_rotation_s")
        first = r.get("first_failed_connect_s")
        if rot is None:
            value, met = "the replica never left the routing table", False
        elif first is not None:
            since = rot - first
            value = (
                f"{since:.1f} s (the route left the table {rot:.1f} s after the fault; first "
                f"failed connect +{first:.1f} s, {r.get('first_failed_connect_from')})"
            )
            met = since <= TARGET_NODE_ROTATION_S
        else:
            value = f"{rot:.1f} s after the fault (raw: no failed connect observed to subtract)"
            met = rot <= TARGET_NODE_ROTATION_S
        out.append(
            _target(
                f"node loss: out of rotation ≤ {TARGET_NODE_ROTATION_S:.0f} s after the first "
                "failed connect",
                value + err(r),
                met and not r.get("error"),
            )
        )
        failed = r.get("failed")
        plain = None if failed is None else failed["plain"]
        out.append(
            _target(
                "node loss: 0 plain requests failed",
                f"{plain} of {None if r.get('sent') is None else r['sent']['plain']} plain "
                f"failed ({None if failed is None else failed['stream']} streams){err(r)}",
                not r.get("error") and plain == 0,
            )
        )
    if (r := by.get("ctld-outage")) is not None:
        failed = _failed_total(r)
        transitions = r.get("transitions_during_outage")
        out.append(
            _target(
                "slurmctld down 60 s: 0 failed, 0 false transitions",
                f"{failed} failed, {transitions} transition lines during the outage{err(r)}",
                not r.get("error") and failed == 0 and transitions == 0,
            )
        )
    if (r := by.get("crash-loop")) is not None:
        attempts = r.get("attempts")
        failed_dep = bool(r.get("deployment_failed"))
        out.append(
            _target(
                f"crash loop: ≤ {TARGET_CRASH_ATTEMPTS} attempts, then FAILED",
                f"{attempts} replacement start(s), "
                f"{'then FAILED' if failed_dep else 'not FAILED'}{err(r)}",
                not r.get("error")
                and failed_dep
                and attempts is not None
                and attempts <= TARGET_CRASH_ATTEMPTS,
            )
        )
    return out


@dataclass
class Summary:
    text: str
    data: dict[str, Any]


HEADER = (
    "| scenario | requests plain / stream | failed plain / stream | truncated 200s "
    "| out of rotation s | capacity restored s | extra jobs | leaked jobs | notes |"
)


def summarize(records: Sequence[dict[str, Any]], params: dict[str, Any]) -> Summary:
    lines: list[str] = []
    out = lines.append
    out(
        "## Continuity under faults: dev cluster, tiny model, transformers engine, steady "
        "traffic through `xhpc proxy`"
    )
    out("")
    out(
        "2 traffic threads (plain and streamed requests alternately, every answer checked); "
        "[lifecycle] backoff_s = 1, lost_grace_s = 20 (walltime: 3-minute jobs, "
        f"handover_floor_s = 120); broker down {params.get('broker_down_s', BROKER_DOWN_S):.0f} s; "
        f"slurmctld down {CTLD_DOWN_S:.0f} s. Times in s from the fault; the broker's routes and "
        f"replicas sampled every {POLL_S} s."
    )
    out("")
    out(HEADER)
    out("|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        out(row(rec))
    targets = evaluate_targets(records)
    out("")
    out("### Targets")
    out("")
    out("| target | value | met |")
    out("|---|---|---|")
    for t in targets:
        met = "yes" if t["met"] else "**no**"
        out(f"| {t['target']} | {t['value'].replace('|', '/')} | {met} |")
    ran = {r["scenario"] for r in records}
    not_run = [n for n in NAMES if n not in ran]
    if not_run:
        out("")
        out(f"Not run: {', '.join(not_run)}.")
    data = {"params": dict(params), "scenarios": list(records), "targets": targets}
    return Summary("\n".join(lines), data)


# --- arguments ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n", 1)[0],
        epilog="Scenarios: " + ", ".join(NAMES),
    )
    ap.add_argument("--short", action="store_true", help="only engine-kill and requeue (~5 min)")
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run only these scenarios")
    ap.add_argument(
        "--broker-down-s",
        type=float,
        default=BROKER_DOWN_S,
        help=f"how long the broker stays down (default {BROKER_DOWN_S:.0f}; 300: 5 minutes)",
    )
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the logs (always kept on errors)")
    args = ap.parse_args(argv)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in NAMES]
        if unknown or not wanted:
            ap.error(
                f"unknown scenario(s) {', '.join(unknown) or '(none)'}; know {', '.join(NAMES)}"
            )
        args.scenarios = [n for n in NAMES if n in wanted]
    elif args.short:
        args.scenarios = list(SHORT)
    else:
        args.scenarios = list(NAMES)
    if args.broker_down_s <= 0:
        ap.error("--broker-down-s must be positive")
    return args


# --- the cluster side --------------------------------------------------------------------------


class Poller:
    """Every POLL_S, the broker's routes and replicas for one model (GET /v1/routes, GET
    /v1/replicas?all=1, as `xhpc ps --all --json`), and, once armed, a TCP connect to one
    endpoint (the first failed connect after the fault)."""

    def __init__(self, socket_path: Path, model: str) -> None:
        from xhpc.cli.client import BrokerClient

        self.client = BrokerClient(socket_path, timeout_s=2.0)
        self.model = model
        self.samples: list[Sample] = []
        self.rows: list[dict[str, Any]] | None = None  # the latest answer
        self.job_ids: set[str] = set()
        self.replica_ids: set[str] = set()
        self.probe: tuple[str, int] | None = None
        self.probe_failed_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

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

    def _loop(self) -> None:
        from xhpc.errors import XhpcError

        while not self._stop.is_set():
            began = time.monotonic()
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
            self._stop.wait(max(0.0, POLL_S - (time.monotonic() - began)))

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


class JobPoller:
    """Every JOB_POLL_S, this state directory's jobs in squeue (by their output path): every job
    id seen, and the peak of live jobs beyond one per replica (by the job's tag, `--comment`
    ``xhpc:BROKER:DEPLOYMENT:REPLICA``)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = str(state_dir)
        self.job_ids: set[str] = set()
        self.duplicates_peak = 0
        self.duplicates_seen: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> JobPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        from tests.conftest import slurm_env

        while not self._stop.is_set():
            began = time.monotonic()
            try:
                out = subprocess.run(
                    ["squeue", "-h", "-o", "%i|%T|%o|%k"], env=slurm_env(), check=True,
                    capture_output=True, text=True, timeout=10,
                ).stdout  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                out = None  # slurmctld down: nothing learnt this time
            if out is not None:
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
            self._stop.wait(max(0.0, JOB_POLL_S - (time.monotonic() - began)))


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


def _own_children_reaped(xhpc_bin: str) -> None:
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


@dataclass
class Ctx:
    """One scenario's run: its xhpc, model, figures, traffic and pollers."""

    x: Xhpc
    name: str
    rec: dict[str, Any]
    work: Path
    args: argparse.Namespace
    first: list[dict[str, Any]] = field(default_factory=list)
    load: Traffic | None = None
    poller: Poller | None = None
    jobs: JobPoller | None = None
    fault_at: float | None = None  # monotonic
    fault_epoch: float | None = None
    victim: str | None = None  # the replica the fault hits
    ready_before: int | None = None
    marker: Path | None = None  # the crash loop's: the engine crashes while it exists

    def fault(self) -> None:
        self.ready_before = len(self.ready())
        self.fault_epoch = time.time()
        self.fault_at = time.monotonic()

    def ready(self) -> list[dict[str, Any]]:
        assert self.poller is not None
        return self.poller.ready_rows()

    def seen_left(self) -> bool:
        """Whether the victim has been out of the routing table since the fault."""
        assert self.poller is not None and self.victim is not None and self.fault_at is not None
        return out_of_rotation(self.poller.snapshot(), self.victim, self.fault_at) is not None

    def note(self, text: str) -> None:
        self.rec["notes"].append(text)

    def since_fault(self, t: float | None) -> float | None:
        return None if t is None or self.fault_at is None else round(t - self.fault_at, 3)

    def proc(self, what: str) -> subprocess.Popen[bytes]:
        """The broker's or the proxy's process (Xhpc.start runs [XHPC, what])."""
        return next(p for p in self.x.procs if isinstance(p.args, list) and p.args[-1] == what)


# --- the scenarios -----------------------------------------------------------------------------


def engine_kill(c: Ctx) -> None:
    from tests.cluster.test_chaos import engine_pid
    from tests.conftest import wait_for

    victim = c.first[0]
    c.victim = victim["replica_id"]
    pid = engine_pid(victim["replica_id"], str(victim["job_id"]))
    c.fault()
    os.kill(pid, signal.SIGKILL)

    def replaced() -> bool:
        rows = c.ready()
        return len(rows) >= len(c.first) and c.victim not in {r["replica_id"] for r in rows}

    wait_for(replaced, 180, "a replacement READY in the killed replica's place")
    c.rec["jobs_needed"] = len(c.first) + 1
    new = sorted({r["replica_id"] for r in c.ready()} - {r["replica_id"] for r in c.first})
    c.note(f"replaced by {', '.join(new) or '?'}")


def requeue(c: Ctx) -> None:
    from tests.conftest import slurm_env, wait_for

    victim = c.first[0]
    c.victim = victim["replica_id"]
    job = str(victim["job_id"])
    c.fault()
    subprocess.run(["scontrol", "requeue", job], env=slurm_env(), check=True, timeout=30)
    left = when(
        lambda: job_state(job) not in (None, "RUNNING"),
        30, "the job to leave RUNNING (squeue)", 0.1,
    )  # fmt: skip
    c.rec["left_running_s"] = c.since_fault(left)

    def back() -> bool:
        return c.seen_left() and c.victim in {r["replica_id"] for r in c.ready()}

    wait_for(back, 180, "the requeued replica READY again")
    assert c.load is not None
    c.rec["failed_after_left_running"] = sum(1 for o in c.load.failures() if o.at >= left)
    c.rec["jobs_needed"] = len(c.first)
    rows = {r["replica_id"]: r for r in c.poller.latest() or ()} if c.poller else {}
    same = str(rows.get(c.victim, {}).get("job_id")) == job
    c.note(f"left RUNNING +{_s(c.rec['left_running_s'])} s; {'same job' if same else 'NEW job'}")


def proxy_worker_kill(c: Ctx) -> None:
    from tests.conftest import wait_for

    sup = c.proc("proxy").pid
    port = c.x.proxy_port
    workers = child_pids(sup)
    if not workers:
        raise RuntimeError(f"no worker process under the proxy supervisor (pid {sup})")
    count = len(workers)

    chosen: list[int] = []

    def busiest() -> bool:
        held = {pid: client_connections(pid, port) for pid in child_pids(sup)}
        pid = max(held, key=lambda p: held[p], default=0)
        chosen[:] = [pid] if pid and held[pid] > 0 else []
        return bool(chosen)

    when(busiest, 30, "a proxy worker with a client connection", 0.01)
    pid = chosen[0]
    assert c.load is not None
    held = client_connections(pid, port)  # again, just before the kill
    done_before = len(c.load.snapshot())
    c.fault()
    os.kill(pid, signal.SIGKILL)
    c.rec["killed_worker"] = pid
    c.rec["in_flight_at_killed_worker"] = held
    load = c.load
    back = when(
        lambda: len(p := child_pids(sup)) >= count and pid not in p,
        60, "the supervisor to restart the worker", 0.05,
    )  # fmt: skip
    c.rec["worker_back_s"] = c.since_fault(back)
    wait_for(lambda: load.ok_since(back) >= 10, 60, "traffic after the restart")
    fault = c.fault_at or 0.0
    outs = load.snapshot()
    c.rec["in_flight_client_side"] = sum(o.at < fault for o in outs) - done_before
    c.rec["failed_after_kill"] = sum(1 for o in load.failures() if o.at >= fault)
    c.rec["jobs_needed"] = len(c.first)
    c.note(
        f"{count} workers; the killed one held {held} connection(s) "
        f"(≤{c.rec['in_flight_client_side']} in flight in all); back in "
        f"{_s(c.rec['worker_back_s'])} s"
    )


def proxy_reload(c: Ctx) -> None:
    sup = c.proc("proxy").pid
    old = set(child_pids(sup))
    if not old:
        raise RuntimeError(f"no worker process under the proxy supervisor (pid {sup})")
    c.fault()
    os.kill(sup, signal.SIGHUP)
    new_only = when(
        lambda: len(p := set(child_pids(sup))) >= len(old) and not (p & old),
        120, "the reload: only new workers left", 0.05,
    )  # fmt: skip
    c.rec["reload_s"] = c.since_fault(new_only)
    c.rec["jobs_needed"] = len(c.first)
    c.note(f"{len(old)} old workers gone, new ones serving, {_s(c.rec['reload_s'])} s after SIGHUP")


def broker_kill(c: Ctx) -> None:
    from tests.cluster.test_chaos import broker_log, replicas
    from tests.conftest import wait_for

    down_s = float(c.args.broker_down_s)
    c.rec["broker_down_s"] = down_s
    broker = c.proc("broker")
    lost_before = broker_log(c.x).count("to=LOST")
    jobs_before = {str(r["job_id"]) for r in c.first}
    c.fault()
    broker.send_signal(signal.SIGKILL)
    broker.wait(10)
    down = time.monotonic()
    wait_for(lambda: time.monotonic() - down >= down_s, down_s + 30, "the broker's outage", 0.5)
    c.x.procs.remove(broker)
    c.x.procs.insert(0, c.x.start("broker"))  # first in the list, as _start_xhpc has it
    c.x.procs.pop()  # (start() appended it too)
    wait_for(lambda: c.x.run("ps", check=False).returncode == 0, 30, "the broker back")
    back = time.monotonic()
    c.rec["broker_back_s"] = c.since_fault(back)
    wait_for(
        lambda: time.monotonic() - back >= BROKER_SETTLE_S,
        BROKER_SETTLE_S + 30, "past the broker's restart grace", 0.5,
    )  # fmt: skip
    rows = replicas(c.x, c.name)
    assert c.poller is not None and c.jobs is not None
    seen = c.poller.job_ids | c.jobs.job_ids | {str(r["job_id"]) for r in rows if r["job_id"]}
    c.rec["relaunches"] = len(seen - jobs_before)
    c.rec["duplicate_jobs"] = c.jobs.duplicates_peak
    c.rec["lost_transitions"] = broker_log(c.x).count("to=LOST") - lost_before
    c.rec["jobs_needed"] = len(c.first)
    states = [r["state"] for r in rows]
    c.note(f"replicas after: {'/'.join(states)}; {c.rec['lost_transitions']} to LOST")


def preemption(c: Ctx) -> None:
    from tests.conftest import slurm_env, wait_for

    victim = c.first[0]
    c.victim = victim["replica_id"]
    node = str(victim["node"])
    script = c.x.state_dir / "urgent.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --partition=urgent\n#SBATCH --gres=gpu:4\n"
        f"#SBATCH --nodelist={node}\n#SBATCH --time=5\n#SBATCH --output=/dev/null\nsleep 600\n"
    )
    urgent = ""
    c.fault()
    try:
        urgent = subprocess.run(
            ["sbatch", "--parsable", str(script)], env=slurm_env(), check=True,
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip

        def moved() -> bool:
            rows = c.ready()
            return len(rows) >= len(c.first) and node not in {r["node"] for r in rows}

        wait_for(moved, 240, "the preempted replica READY on another node")
        after = time.monotonic()
        wait_for(lambda: c.load is not None and c.load.ok_since(after) >= 10, 60, "traffic")
    finally:
        if urgent:
            subprocess.run(["scancel", urgent], env=slurm_env(), check=False, timeout=30)
    c.rec["jobs_needed"] = len(c.first) + 1  # the move may need a new job (re-plan)
    c.note(f"urgent job {urgent} on {node}")


def node_loss(c: Ctx) -> None:
    from tests.conftest import DEV_CLUSTER, wait_for

    victim = c.first[0]
    c.victim = victim["replica_id"]
    node = str(victim["node"])
    k = node.removeprefix("n")
    if len({r["node"] for r in c.first}) < len(c.first):
        c.note(f"replicas share a node ({', '.join(str(r['node']) for r in c.first)})")
    assert c.poller is not None
    probe = (str(victim.get("host") or ""), int(victim.get("port") or 0))
    answers = False
    with contextlib.suppress(OSError), socket.create_connection(probe, timeout=1.0):
        answers = True  # this bench's own probe counts only if it connects before the fault
    c.fault()
    try:
        subprocess.run([str(DEV_CLUSTER), "node-fail", k], check=True, timeout=60)
        if answers:
            c.poller.arm_probe(*probe)  # a connect at each poll until one fails

        def moved() -> bool:
            rows = c.ready()
            return len(rows) >= len(c.first) and node not in {r["node"] for r in rows}

        wait_for(moved, 300, "the lost node's replica READY on another node")
        after = time.monotonic()
        wait_for(lambda: c.load is not None and c.load.ok_since(after) >= 10, 60, "traffic")
    finally:
        subprocess.run([str(DEV_CLUSTER), "node-up", k], check=False, timeout=120)
        try:
            wait_for(
                lambda: node_state(node).rstrip("*~#") in ("idle", "mixed", "allocated"),
                120, f"{node} back in Slurm", 1.0,
            )  # fmt: skip
        except AssertionError:
            c.note(f"{node} not back after 120 s: {node_state(node)}")
    # The first failed connect: the proxy's log or this bench's own probe, whichever is first.
    fault, epoch = c.fault_at or 0.0, c.fault_epoch or 0.0
    candidates: list[tuple[float, str]] = []
    log_text = (c.x.state_dir / "proxy.log").read_text(errors="replace")
    at = first_failed_connect(log_text, victim["replica_id"], epoch)
    if at is not None:
        candidates.append((at - epoch, "the proxy's log"))
    if c.poller.probe_failed_at is not None:
        candidates.append((c.poller.probe_failed_at - fault, "this bench's TCP probe"))
    c.rec["first_failed_connect_candidates"] = [
        {"s": round(s, 3), "from": w} for s, w in candidates
    ]
    if candidates:
        first, source = min(candidates)
        c.rec["first_failed_connect_s"] = round(max(0.0, first), 3)
        c.rec["first_failed_connect_from"] = source
    c.rec["jobs_needed"] = len(c.first) + 1  # the move may need a new job
    c.note(f"{node} failed")


def ctld_outage(c: Ctx) -> None:
    from tests.cluster.test_chaos import replicas
    from tests.conftest import DEV_CLUSTER, wait_for

    log_path = c.x.state_dir / "broker.log"
    jobs_before = {str(r["job_id"]) for r in c.first}
    c.fault()
    start_off = log_path.stat().st_size
    try:
        subprocess.run([str(DEV_CLUSTER), "ctld-stop"], check=True, timeout=60)
        down = time.monotonic()
        wait_for(lambda: time.monotonic() - down >= CTLD_DOWN_S, CTLD_DOWN_S + 30, "60 s", 0.5)
    finally:
        end_off = log_path.stat().st_size
        subprocess.run([str(DEV_CLUSTER), "ctld-start"], check=False, timeout=120)
    with log_path.open("rb") as f:
        f.seek(start_off)
        during = f.read(max(0, end_off - start_off)).decode(errors="replace")
    c.rec["transitions_during_outage"] = during.count("transition ")
    c.rec["transition_lines"] = [ln for ln in during.splitlines() if "transition " in ln][:10]
    up = time.monotonic()
    wait_for(lambda: c.load is not None and c.load.ok_since(up) >= 20, 90, "traffic after")
    wait_for(_squeue_ok, 60, "squeue answering again", 1.0)
    rows = replicas(c.x, c.name)
    same = {str(r["job_id"]) for r in rows} == jobs_before
    c.rec["jobs_needed"] = len(c.first)
    c.note(
        f"replicas after: {'/'.join(r['state'] for r in rows)}, "
        f"{'same jobs' if same else 'jobs CHANGED'}"
    )


def _squeue_ok() -> bool:
    from tests.conftest import slurm_env

    return (
        subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=slurm_env(), capture_output=True, timeout=15
        ).returncode
        == 0
    )


def walltime(c: Ctx) -> None:
    from tests.cluster.test_chaos import broker_log
    from tests.conftest import wait_for

    c.fault()  # t0: the handovers come by themselves
    wait_for(
        lambda: broker_log(c.x).count("action=retire") >= WALLTIME_HANDOVERS,
        480, f"{WALLTIME_HANDOVERS} walltime handovers", 1.0,
    )  # fmt: skip
    text = broker_log(c.x)
    c.rec["handovers"] = text.count("action=retire")
    c.rec["successors"] = text.count("action=successor")
    assert c.poller is not None
    c.rec["route_gap_s"] = round(route_gap(c.poller.snapshot(), c.fault_at or 0.0), 3)
    c.note(
        f"{c.rec['handovers']} handovers ({c.rec['successors']} successors); longest time "
        f"without a route {c.rec['route_gap_s']:.1f} s"
    )


def crash_loop(c: Ctx) -> None:
    from tests.cluster.test_chaos import engine_pid, replicas
    from tests.conftest import wait_for

    assert c.marker is not None
    marker = c.marker
    (first,) = c.first
    c.victim = first["replica_id"]
    pid = engine_pid(first["replica_id"], str(first["job_id"]), b"echo_engine")
    marker.write_text("")
    c.fault()
    os.kill(pid, signal.SIGKILL)

    def failed() -> str:
        out = c.x.run("ps", check=False).stdout
        return out if f"{c.name}: FAILED: crash loop" in out else ""

    shown = str(wait_for(failed, 240, "the deployment to fail as a crash loop", 1.0))
    c.rec["failed_s"] = c.since_fault(time.monotonic())
    c.rec["deployment_failed"] = True
    line = next((ln for ln in shown.splitlines() if f"{c.name}: FAILED" in ln), "")
    c.rec["failed_line"] = line[:300]
    every = replicas(c.x, c.name, all_=True)
    c.rec["attempts"] = len(every) - 1
    c.rec["jobs_needed"] = len(every)
    c.note(f"{len(every) - 1} replacement start(s), then FAILED after {_s(c.rec['failed_s'])} s")


@dataclass(frozen=True)
class Spec:
    body: Callable[[Ctx], None]
    config: str  # chaos | walltime | crash


SPECS: dict[str, Spec] = {
    "engine-kill": Spec(engine_kill, "chaos"),
    "requeue": Spec(requeue, "chaos"),
    "proxy-worker-kill": Spec(proxy_worker_kill, "chaos"),
    "proxy-reload": Spec(proxy_reload, "chaos"),
    "broker-kill": Spec(broker_kill, "chaos"),
    "preemption": Spec(preemption, "chaos"),
    "node-loss": Spec(node_loss, "chaos"),
    "ctld-outage": Spec(ctld_outage, "chaos"),
    "walltime": Spec(walltime, "walltime"),
    "crash-loop": Spec(crash_loop, "crash"),
}


def _config(spec: Spec, marker: Path) -> str:
    from tests.cluster.test_chaos import CHAOS_CONFIG, WALLTIME_CONFIG
    from tests.cluster.test_pilot import ECHO

    if spec.config == "walltime":
        return WALLTIME_CONFIG
    if spec.config == "crash":  # the chaos suite's crash-loop engine
        return (
            CHAOS_CONFIG
            + f"""
[engines.command]
command = ["{sys.executable}", "{ECHO}", "--port", "{{port}}",
           "--served-model", "{{served_model}}", "--crash-if", "{marker}"]
startup_timeout_s = 60
"""
        )
    return CHAOS_CONFIG


def _serve(c: Ctx, spec: Spec) -> list[dict[str, Any]]:
    from tests.cluster.test_chaos import serve

    if spec.config == "walltime":
        return serve(c.x, c.name, "--time", "00:03:00")
    if spec.config == "crash":
        dep = json.loads(
            c.x.run("serve", "tiny-llama", "--name", c.name, "--engine", "command",
                    "--timeout", "90", "--json").stdout
        )  # fmt: skip
        rows: list[dict[str, Any]] = dep["replicas"]
        return rows
    return serve(c.x, c.name, "--replicas", "2")


def run_scenario(
    name: str, args: argparse.Namespace, work: Path, records: list[dict[str, Any]]
) -> None:
    """Run one scenario; its figures go into ``records`` at once (an interrupted one keeps
    what it had). The broker and the proxy are the chaos suite's ``own_xhpc``: torn down
    (their jobs cancelled) however the scenario ends."""
    from tests.conftest import XHPC, own_xhpc

    rec: dict[str, Any] = {"scenario": name, "error": None, "notes": []}
    records.append(rec)
    started = time.monotonic()
    out_dir = work / name
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / "crash-now"
    log(f"{name}: starting a broker and a proxy")
    up = False
    try:
        with own_xhpc(MODEL_DIR, _config(SPECS[name], marker)) as x:
            up = True
            c = Ctx(x=x, name=f"c{uuid.uuid4().hex[:7]}", rec=rec, work=work, args=args)
            c.marker = marker
            rec["model"] = c.name
            try:
                _run(c, name)
            finally:
                _finish(c, out_dir)
    except Exception as err:  # the start or the teardown
        if up:
            rec["notes"].append(f"teardown: {type(err).__name__}: {err}")
        else:  # no Xhpc to tear down: stop what this process started
            _own_children_reaped(XHPC)
            rec["error"] = f"start: {type(err).__name__}: {err}"
    finally:
        rec["seconds"] = round(time.monotonic() - started, 1)
    log(f"{name}: done in {rec['seconds']:.0f} s")


def _run(c: Ctx, name: str) -> None:
    """Serve, start the pollers and the traffic, inject the fault, see traffic flow after it.
    A failure is recorded in the scenario's figures (``error``), not raised."""
    from tests.cluster.traffic import Traffic
    from tests.conftest import wait_for

    x, rec, spec = c.x, c.rec, SPECS[name]
    try:
        log(f"{name}: serving {c.name}")
        c.first = _serve(c, spec)
        rec["replicas"] = len(c.first)
        rec["jobs_initial"] = sorted(str(r["job_id"]) for r in c.first)
        c.poller = Poller(x.state_dir / "broker.sock", c.name).start()
        c.jobs = JobPoller(x.state_dir).start()
        wait_for(lambda: len(c.ready()) >= len(c.first), 30, "the poller to see the replicas")
        wait_for(
            lambda: all(proxy_routes(x.proxy_port) >= len(c.first) for _ in range(4)),
            30, "the proxy's workers to route to every replica",
        )  # fmt: skip
        if name not in NO_TRAFFIC:
            c.load = Traffic(x.proxy_url, c.name).__enter__()
            load = c.load
            wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
        log(f"{name}: fault")
        spec.body(c)
        if c.load is not None:
            after = time.monotonic()
            load = c.load
            wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the fault")
    except Exception as err:
        rec["error"] = f"{type(err).__name__}: {err}"
        log(f"{name}: FAILED: {rec['error']}\n{traceback.format_exc()}")
    except BaseException as stop:  # SIGTERM, ^C: torn down by the caller, then it stops
        rec["error"] = f"interrupted ({stop!r})"
        raise


def _finish(c: Ctx, out_dir: Path) -> None:
    """Stop the traffic and the pollers, record the figures, stop the model, count its jobs left,
    keep its logs. Every step on its own: one failing does not skip the others."""
    rec, x = c.rec, c.x
    if c.load is not None:
        with contextlib.suppress(Exception):
            c.load.stop()
        rec.update(traffic_figures(c.load.snapshot(), c.fault_at))
    for poller in (c.poller, c.jobs):
        if poller is not None:
            with contextlib.suppress(Exception):
                poller.stop()
    if c.poller is not None:
        samples = c.poller.snapshot()
        rec["samples"] = len(samples)
        rec["victim"] = c.victim
        if c.fault_at is not None:
            rec["fault_at_s"] = round(c.fault_at - (samples[0].t if samples else c.fault_at), 3)
            if c.victim is not None:
                rot = out_of_rotation(samples, c.victim, c.fault_at)
                rec["out_of_rotation_s"] = None if rot is None else round(rot, 3)
                first = rec.get("first_failed_connect_s")
                if rot is not None and first is not None:
                    rec["out_of_rotation_after_connect_s"] = round(rot - first, 3)
            if c.ready_before is not None:
                dropped, back = restored(samples, c.ready_before, c.fault_at)
                rec["ready_before"] = c.ready_before
                rec["dropped"] = dropped
                rec["restored_s"] = None if back is None else round(back, 3)
        seen = set(c.poller.job_ids) | {str(r["job_id"]) for r in c.first if r.get("job_id")}
        if c.jobs is not None:
            seen |= c.jobs.job_ids
            rec["duplicate_jobs_peak"] = c.jobs.duplicates_peak
            rec["duplicate_jobs_seen"] = c.jobs.duplicates_seen
        rec["jobs_seen"] = sorted(seen, key=lambda j: (len(j), j))
        rec["replicas_seen"] = sorted(c.poller.replica_ids)
        if rec["scenario"] == "walltime":  # one job per successor the handovers needed
            with contextlib.suppress(OSError):
                text = (x.state_dir / "broker.log").read_text(errors="replace")
                rec["jobs_needed"] = 1 + text.count("action=successor")
        if rec.get("jobs_needed") is not None:
            rec["extra_jobs"] = max(0, len(seen) - int(rec["jobs_needed"]))
    # Stop the model, then count its jobs left in squeue.
    try:
        x.run("stop", c.name, check=False, timeout=300)
        deadline = time.monotonic() + LEAK_WAIT_S
        left = x.my_jobs()
        while left and time.monotonic() < deadline:
            time.sleep(1.0)
            left = x.my_jobs()
        rec["leaked_jobs"] = len(left)
        rec["leaked_job_ids"] = left
    except Exception as err:
        rec["notes"].append(f"leak check: {type(err).__name__}: {err}")
    # The crash loop: nothing relaunched after FAILED (the chaos suite's last check).
    if rec["scenario"] == "crash-loop" and rec.get("attempts") is not None:
        with contextlib.suppress(Exception):
            rows = json.loads(x.run("ps", "--all", "--json").stdout)
            rec["replicas_after_stop"] = sum(r["deployment"] == c.name for r in rows)
    if rec.get("replicas_after_stop", 0) > (rec.get("attempts") or 0) + 1:
        rec["notes"].append(f"{rec['replicas_after_stop']} replicas after FAILED: relaunched")
    for item in x.state_dir.iterdir():
        if item.is_file() and (item.suffix in (".log", ".toml", ".sbatch")):
            with contextlib.suppress(OSError):
                shutil.copy2(item, out_dir / item.name)


def preflight(scenarios: Sequence[str]) -> list[str]:
    from tests.conftest import DEV_CLUSTER, XHPC

    problems = []
    if not Path(XHPC).exists():
        problems.append(f"no {XHPC}: run this with .venv/bin/python")
    if not TRANSFORMERS_PY.exists():
        problems.append(f"no {TRANSFORMERS_PY} (scripts/setup-engines transformers)")
    if subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True).returncode != 0:
        problems.append("the dev cluster is not up (scripts/dev-cluster up)")
    root_only = [n for n in scenarios if n in ("node-loss", "ctld-outage")]
    if root_only and os.geteuid() != 0:
        problems.append(f"not root: {', '.join(root_only)} need(s) root (scripts/dev-cluster)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problems = preflight(args.scenarios)
    if problems:
        for p in problems:
            log(f"ERROR: {p}")
        return 1
    if not (MODEL_DIR / "config.json").exists():
        log(f"making {MODEL_DIR} (scripts/make-tiny-model)")
        subprocess.run(
            [str(ROOT / "scripts" / "make-tiny-model"), str(MODEL_DIR)],
            check=True, capture_output=True,
        )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="xhpc-bench-continuity-"))

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    records: list[dict[str, Any]] = []
    status = 0
    try:
        for name in args.scenarios:
            run_scenario(name, args, work, records)
    except (KeyboardInterrupt, SystemExit) as stop:
        log(f"interrupted ({stop!r}): the table has what the scenarios had when it came")
        code = stop.code if isinstance(stop, SystemExit) else None
        status = code if isinstance(code, int) and code else 130
    params = {
        "scenarios": list(args.scenarios),
        "broker_down_s": args.broker_down_s,
        "ctld_down_s": CTLD_DOWN_S,
        "poll_s": POLL_S,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
    }
    summary = summarize(records, params)
    seconds = time.monotonic() - t_start
    print(summary.text)
    print(f"\n(run took {seconds:.0f}s)")
    errors = [r["scenario"] for r in records if r.get("error")]
    if args.json:
        summary.data["seconds"] = round(seconds, 1)
        args.json.write_text(json.dumps(summary.data, indent=2, default=str))
    if args.keep or errors or status:
        log(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if status:
        return status
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
