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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, tests, bench._common, bench._continuity

from bench._common import ensure_tiny_model, exit_on_sigterm  # noqa: E402
from bench._continuity.params import (  # noqa: E402
    BROKER_DOWN_S,
    CTLD_DOWN_S,
    MODEL_DIR,
    NAMES,
    POLL_S,
    SHORT,
    TRANSFORMERS_PY,
    log,
)
from bench._continuity.scenarios import run_scenario  # noqa: E402
from bench._continuity.table import summarize  # noqa: E402


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
    ensure_tiny_model(log, MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="xhpc-bench-continuity-"))
    exit_on_sigterm()
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
