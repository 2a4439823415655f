"""The gateway's overhead, side by side: direct, the xhpc proxy, nginx proxy_pass, LiteLLM's proxy.

One run, one fast OpenAI-shaped backend (bench/_backend.py: raw asyncio, prepared answers), four
ways to reach it, measured interleaved: every round runs each workload once per contender, the
contenders' order rotated round by round so that drift hits all of them alike.

    direct       the load generator talks to the backend itself
    xhpc proxy   the real `xhpc proxy --workers 1` process (the CLI, as operators run it), its
                 routing table served by a stand-in broker on its UNIX socket (POST
                 /v1/proxy/sync answered by the backend process) with one route to the backend
    nginx        the Debian package's nginx, `proxy_pass` to an upstream keep-alive pool,
                 buffering off (as SSE needs), our own config in a temp dir, `daemon off`
    LiteLLM      `litellm --config` (PyPI litellm[proxy], pinned, its own venv .venvs/litellm),
                 the backend as an OpenAI-compatible model (`openai/...`, `api_base`), 1 worker

Workloads (POST /v1/chat/completions):

    c=1, c=64    non-streaming, closed loop on keep-alive connections for a fixed time: latency
                 p50/p99 per round, requests per second; "added" = contender - direct, per round
    SSE 1, 32    streams of ``--tokens`` tokens (role, content, finish, usage chunks and
                 ``data: [DONE]``), one event every ``--interval-ms`` from the backend: TTFT
                 (first event) added over direct, inter-event gap p99 (ITL), and per stream: the
                 event count equal to what the backend sent, the final [DONE], the body
                 byte-exact

Cores: with two or more CPUs the proxies (xhpc, nginx with 1 worker, LiteLLM with 1 worker) are
pinned to one core (`taskset -c P`) and the load generator and the backend to another (`taskset
-c L`), so a proxy has one core to itself ("RPS on one core") and never competes with the client.
The load generator is a raw asyncio HTTP/1.1 client (bench/_http.py); what it can do is printed:
its rate against the backend (direct, both on core L) and against nginx's static answer (`return
200`, nginx on core P), the ceiling of any contender's RPS here.

Every figure is the median of the round values with [min, max]; ratios are of those medians.

    .venv/bin/python bench/proxy.py [--short] [--rounds N] [--json FILE] [--require-all]

Needs nginx and .venvs/litellm (`scripts/setup-bench`); a missing one is left out with a note,
or is an error with --require-all. Exit status 0 when the table was printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))  # _http, _backend: imported by name, as the scripts here do
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, bench._proxy

from _backend import events  # noqa: E402

from bench._common import Procs, emit, exit_on_sigterm  # noqa: E402
from bench._proxy.launch import pick_cores, start_all  # noqa: E402
from bench._proxy.measure import run_rounds  # noqa: E402
from bench._proxy.params import FULL, SHORT, Params, log  # noqa: E402
from bench._proxy.table import summarize  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 2 short rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 2 with --short)")
    ap.add_argument("--tokens", type=int, help="tokens per stream (default 16)")
    ap.add_argument("--interval-ms", type=float, help="between stream events (default 10)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument(
        "--require-all", action="store_true", help="fail when nginx or LiteLLM is not installed"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    given = {"rounds": args.rounds, "tokens": args.tokens, "interval_ms": args.interval_ms}
    p = Params(**{**p.__dict__, **{k: v for k, v in given.items() if v}})
    cores = pick_cores()
    if cores.load is not None:
        os.sched_setaffinity(0, {cores.load})
    log(f"cores: {cores.describe()}")
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-proxy-"))
    procs = Procs(tmp, die_with_parent=False, grace_s=8.0)
    exit_on_sigterm()
    t_start = time.monotonic()
    try:
        setup = start_all(procs, tmp, cores, p, args.require_all)
        expected = events(p.tokens)
        res = run_rounds(setup, p, expected)
        summary = summarize(res, setup, p, cores, p.tokens)
    except RuntimeError as err:
        log(f"ERROR: {err}")
        return 1
    finally:
        procs.tear_down(args.keep, log)
    emit(summary, t_start, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
