"""The faults, one function per scenario over its run (``Ctx``): each picks its victim, marks
the fault (the moment just before the signal, command or sbatch that injects it), injects it,
waits for the outcome with deadlines (the chaos suite's ``wait_for``, never fixed sleeps), and
records its own figures and notes; the scenario around it (scenarios) serves, samples and tears
down.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .figures import first_failed_connect, logged_at, out_of_rotation, route_gap
from .params import BROKER_SETTLE_S, CTLD_DOWN_S, WALLTIME_HANDOVERS
from .sampling import (
    JobPoller,
    Poller,
    child_pids,
    client_connections,
    job_state,
    job_submit_epoch,
    node_state,
    when,
)
from .table import fmt_s

if TYPE_CHECKING:
    from tests.cluster.traffic import Traffic
    from tests.conftest import Xhpc


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

    def wait_moved_off(self, node: str, timeout_s: float, what: str) -> None:
        """Wait until as many replicas as at first are READY, none on ``node``, then for
        traffic to flow after that."""
        from tests.conftest import wait_for

        def moved() -> bool:
            rows = self.ready()
            return len(rows) >= len(self.first) and node not in {r["node"] for r in rows}

        wait_for(moved, timeout_s, what)
        after = time.monotonic()
        wait_for(lambda: self.load is not None and self.load.ok_since(after) >= 10, 60, "traffic")

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
    c.note(f"left RUNNING +{fmt_s(c.rec['left_running_s'])} s; {'same job' if same else 'NEW job'}")


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
        f"{fmt_s(c.rec['worker_back_s'])} s"
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
    c.note(
        f"{len(old)} old workers gone, new ones serving, {fmt_s(c.rec['reload_s'])} s after SIGHUP"
    )


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
    from tests.conftest import slurm_env

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
        c.wait_moved_off(node, 240, "the preempted replica READY on another node")
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
        c.wait_moved_off(node, 300, "the lost node's replica READY on another node")
        replacement_figures(c)
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


def replacement_figures(c: Ctx) -> None:
    """The replacement's own queue wait + engine start (Slurm's submit time -> READY), and how
    long after the fault it was submitted (Slurm's submit time has whole seconds)."""
    first_jobs = {str(r["job_id"]) for r in c.first}
    new = [str(r["job_id"]) for r in c.ready() if str(r.get("job_id")) not in first_jobs]
    if not new or c.fault_epoch is None:
        c.note("no replacement job seen among the READY replicas")
        return
    submitted = job_submit_epoch(new[0])
    ready = logged_at(
        (c.x.state_dir / "broker.log").read_text(errors="replace"), f"to=READY job={new[0]} "
    )
    if submitted is None or ready is None:
        c.note(f"job {new[0]}: no submit time from Slurm, or no READY line in the broker's log")
        return
    c.rec["replacement_submitted_s"] = round(submitted - c.fault_epoch, 3)
    c.rec["replacement_start_s"] = round(ready - submitted, 3)


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
    c.note(f"{len(every) - 1} replacement start(s), then FAILED after {fmt_s(c.rec['failed_s'])} s")
