"""One scenario from start to teardown: its broker and proxy (the chaos suite's ``own_xhpc``
with the scenario's config), serving, the pollers and the traffic, the fault, then its figures
recorded (traffic, samples, jobs), the model stopped, its jobs left counted and its logs kept,
each step on its own; a failure goes into the scenario's figures, never out of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import faults
from .faults import Ctx
from .figures import out_of_rotation, restored, traffic_figures
from .params import LEAK_WAIT_S, MODEL_DIR, NO_TRAFFIC, log
from .sampling import JobPoller, Poller, own_children_reaped, proxy_routes


@dataclass(frozen=True)
class Spec:
    body: Callable[[Ctx], None]
    config: str  # chaos | walltime | crash


SPECS: dict[str, Spec] = {
    "engine-kill": Spec(faults.engine_kill, "chaos"),
    "requeue": Spec(faults.requeue, "chaos"),
    "proxy-worker-kill": Spec(faults.proxy_worker_kill, "chaos"),
    "proxy-reload": Spec(faults.proxy_reload, "chaos"),
    "broker-kill": Spec(faults.broker_kill, "chaos"),
    "preemption": Spec(faults.preemption, "chaos"),
    "node-loss": Spec(faults.node_loss, "chaos"),
    "ctld-outage": Spec(faults.ctld_outage, "chaos"),
    "walltime": Spec(faults.walltime, "walltime"),
    "crash-loop": Spec(faults.crash_loop, "crash"),
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
            own_children_reaped(XHPC)
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
