"""The PD route, side by side: xhpc's two-phase route vs vLLM's own toy PD proxy, same 1P1D pair.

One run, one prefill/decode pair of real vLLM CPU engines (``.venvs/vllm``, the random-weights
models/tiny-llama, ``NixlConnector`` with ``kv_buffer_device: cpu``, 32-token blocks, as
xhpc/agent/engines.py runs them), two proxies in front of the same pair:

    xhpc proxy      the real `xhpc proxy` process (the CLI, as operators run it), `[proxy] auth =
                    "none"`, its routing table served by a stand-in broker on its UNIX socket
                    (bench/_backend.py answers POST /v1/proxy/sync and /v1/proxy/grants): two
                    routes of one PD unit, role "prefill" -> P and role "decode" -> D
                    (xhpc/proxy/pd.py, decision 0009)
    vLLM toy proxy  vLLM's own example disaggregation proxy, tests/v1/kv_connector/
                    nixl_integration/toy_proxy_server.py of vLLM's sdist (never committed here:
                    scripts/setup-bench extracts it to .venvs/vllm-toy-proxy/), run with
                    .venvs/vllm's python, pointed at the same P and D

Both follow the same protocol (prefill leg with max_tokens 1 and a kv_transfer_params request,
decode leg with P's params), so the difference is what each proxy costs per request.

Workload: chat completions whose prompts span several 32-token KV blocks (a prompt within one
block transfers nothing), greedy (temperature 0), ``max_tokens`` 16; four
workloads: non-streaming and streaming, at concurrency 1 and 4 (closed loop). Every (round,
workload) has its own prompts, sent through both contenders. Measured interleaved:
in every round each workload runs once per contender, the contenders' order
alternating round by round. Both engines run with
``--no-enable-prefix-caching``: every request does its full prefill on P and moves all its
blocks to D, whichever contender sent the prompt first (with prefix caching the second
contender would find the prompt cached on D and move nothing).

Figures: per run (one workload, one contender, one round) latency p50/p90 (request sent -> the
answer complete at the client; nearest rank) and for streams TTFT p50 (the first content token);
"added" = xhpc - toy for the same prompt in the same round, per request, its median per run;
"ratio" = xhpc p50 / toy p50 per run. Each figure is the median of the round values [min, max].

Correctness: every answer's text (streams: the content deltas joined) equals the other
contender's for the same prompt, and the answer of a plain single vLLM instance (same model and
flags, no KV connector; started with the pair, stopped once it has answered every prompt
directly). KV: the decode instance's ``vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}`` read before and after every contender's run: the tokens it took from
the transfer rather than computing them, per contender, against the prompts' tokens.

Nothing is pinned: on a 2-CPU machine each NIXL engine busy-polls a core, and the
engines, the proxies and the load generator share what is left. Expect noise; the figures are
for docs/performance.md, never asserted on.

    .venv/bin/python bench/pd.py [--short] [--rounds N] [--json FILE] [--keep]

``--short`` (CI, tests/test_bench_pd.py): 2 rounds of fewer prompts, ~1.5-2 min with engine
start. Needs .venvs/vllm with nixl (scripts/setup-engines vllm), the toy proxy
(scripts/setup-bench) and models/tiny-llama (scripts/make-tiny-model, made here if missing).
Exit status 0 when the table was printed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, bench._pd

from bench._common import Procs, emit, ensure_tiny_model, exit_on_sigterm  # noqa: E402
from bench._pd.launch import start_all  # noqa: E402
from bench._pd.measure import measure  # noqa: E402
from bench._pd.params import FULL, MODEL_DIR, SHORT, TOY_PROXY, VLLM_PY, Params, log  # noqa: E402
from bench._pd.table import summarize  # noqa: E402


def missing() -> list[str]:
    gone = []
    if not VLLM_PY.exists():
        gone.append(f"{VLLM_PY} (scripts/setup-engines vllm)")
    if not TOY_PROXY.exists():
        gone.append(f"{TOY_PROXY} (scripts/setup-bench)")
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 2 short rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 2 with --short)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    if args.rounds:
        p = Params(**{**asdict(p), "rounds": args.rounds})
    gone = missing()
    if gone:
        log(f"ERROR: not installed: {', '.join(gone)}")
        return 1
    ensure_tiny_model(log, MODEL_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-pd-"))
    procs = Procs(tmp, kill_wait_s=10.0, newest_first=False)
    exit_on_sigterm()
    t_start = time.monotonic()
    try:
        setup = start_all(procs, tmp)
        res = asyncio.run(measure(setup, p, procs))
        summary = summarize(res, setup, p)
    except RuntimeError as err:
        log(f"ERROR: {err}")
        return 1
    finally:
        procs.tear_down(args.keep, log)
    emit(summary, t_start, args.json, f", {setup.start_s:.1f}s of it starting engines and proxies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
