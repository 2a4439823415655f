"""Figures to the tables: nearest-rank percentiles, medians of the round values with
[min, max], the latency table (xhpc against the toy proxy, request by request), the
correctness and KV-transfer table (each output against the other contender's and a single
instance's), and the figures ``--json`` writes.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

from bench._common import Summary, med, spread

from .launch import Setup
from .measure import Results
from .params import BLOCK, KEYS, LABELS, WORKLOADS, Params


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    k = max(0, min(len(vals) - 1, int(-(-q * len(vals) // 1)) - 1))
    return vals[k]


def ratio_spread(values: list[float]) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3f}x [{min(vals):.3f}, {max(vals):.3f}]"


def summarize(res: Results, setup: Setup, p: Params) -> Summary:
    lines: list[str] = []
    out = lines.append
    data: dict[str, Any] = {
        "contenders": [LABELS[k] for k in KEYS],
        "params": asdict(p),
        "versions": setup.versions,
        "start_s": setup.start_s,
    }
    ref_tokens = [a.prompt_tokens or 0 for rs in res.reference.values() for a in rs]
    out(
        f"## PD route: xhpc proxy vs vLLM's toy proxy, 1P1D NixlConnector on CPU, "
        f"{p.rounds} interleaved rounds"
    )
    out("")
    out(
        f"Engines: vLLM {setup.versions.get('vllm', '?')} CPU, models/tiny-llama, "
        f"`kv_buffer_device: cpu`, {BLOCK}-token blocks, prefix caching off; "
        f"the toy proxy: {setup.versions.get('toy proxy', '?')}. Prompts "
        f"{min(ref_tokens)}-{max(ref_tokens)} tokens ({min(ref_tokens) // BLOCK}-"
        f"{max(ref_tokens) // BLOCK} whole blocks), max_tokens {p.max_tokens}, greedy. "
        f"{os.cpu_count()} CPUs, nothing pinned (each NIXL engine busy-polls a core): noisy."
    )
    out("")
    out(
        "### Latency (ms; median of round values [min, max]; added = xhpc - toy for the same "
        "prompt in the same round, median per run)"
    )
    out("")
    out(
        "| contender | workload | requests | p50 ms | p90 ms | TTFT p50 ms "
        "| added per request ms | p50 ratio vs toy | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    data["latency"] = {}
    for key in KEYS:
        for wl in WORKLOADS:
            runs = [res.run(r, wl.key, key) for r in range(p.rounds)]
            base = [res.run(r, wl.key, "toy") for r in range(p.rounds)]
            lat = [[a.latency for a in run.answers] for run in runs]
            p50s = [pct(v, 0.5) for v in lat]
            p90s = [pct(v, 0.9) for v in lat]
            ttfts = [pct([a.ttft for a in run.answers if a.ttft is not None], 0.5) for run in runs]
            n = sum(len(run.answers) for run in runs)
            errs = sum(1 for run in runs for a in run.answers if a.error)
            added = [
                med([a.latency - b.latency for a, b in zip(x.answers, y.answers, strict=True)])
                for x, y in zip(runs, base, strict=True)
            ]
            ratios = [
                pct([a.latency for a in x.answers], 0.5) / pct([b.latency for b in y.answers], 0.5)
                for x, y in zip(runs, base, strict=True)
            ]
            is_base = key == "toy"
            out(
                f"| {LABELS[key]} | {wl.label} | {n} | {spread(p50s)} | {spread(p90s)} "
                f"| {spread(ttfts) if wl.stream else '—'} "
                f"| {'— (baseline)' if is_base else spread(added, digits=2, sign='+')} "
                f"| {'—' if is_base else ratio_spread(ratios)} | {errs} |"
            )
            data["latency"].setdefault(LABELS[key], {})[wl.key] = {
                "requests": n,
                "errors": errs,
                "p50_ms": med(p50s) * 1e3,
                "p90_ms": med(p90s) * 1e3,
                "ttft_p50_ms": med(ttfts) * 1e3 if wl.stream else None,
                "added_ms": None if is_base else med(added) * 1e3,
                "added_ms_rounds": None if is_base else [a * 1e3 for a in added],
                "p50_ratio": None if is_base else med(ratios),
            }

    # every request's added latency, all workloads, as one figure
    all_added = [
        a.latency - b.latency
        for r in range(p.rounds)
        for wl in WORKLOADS
        for a, b in zip(
            res.run(r, wl.key, "xhpc").answers, res.run(r, wl.key, "toy").answers, strict=True
        )
    ]
    out("")
    out(
        f"All {len(all_added)} paired requests: xhpc - toy median "
        f"{med(all_added) * 1e3:+.2f} ms, p10 {pct(all_added, 0.1) * 1e3:+.2f} ms, "
        f"p90 {pct(all_added, 0.9) * 1e3:+.2f} ms."
    )
    data["added_all_ms"] = {
        "median": med(all_added) * 1e3,
        "p10": pct(all_added, 0.1) * 1e3,
        "p90": pct(all_added, 0.9) * 1e3,
        "pairs": len(all_added),
    }

    out("")
    out(
        "### Correctness and KV transfer (outputs: text equal for the same prompt; KV: the "
        'decode instance\'s `prompt_tokens_by_source_total{source="external_kv_transfer"}`, '
        "after - before each run)"
    )
    out("")
    out(
        "| contender | requests | errors | output = other contender's | output = single instance "
        "| prompt tokens sent | KV tokens transferred | runs where KV moved |"
    )
    out("|---|---|---|---|---|---|---|---|")
    data["correctness"] = {}
    mismatches: list[dict[str, Any]] = []
    for key in KEYS:
        other = "xhpc" if key == "toy" else "toy"
        n = errs = same_other = same_ref = 0
        kv = 0.0
        moved = 0
        runs = [run for run in res.runs if run.contender == key]
        prompt_tokens = 0
        for run in runs:
            refs = res.reference[(run.round, run.workload)]
            others = res.run(run.round, run.workload, other).answers
            kv += run.kv_tokens
            moved += run.kv_tokens > 0
            for i, (a, o, ref) in enumerate(zip(run.answers, others, refs, strict=True)):
                n += 1
                prompt_tokens += ref.prompt_tokens or 0
                if a.error:
                    errs += 1
                    continue
                same_other += a.text == o.text and o.error is None
                same_ref += a.text == ref.text
                if a.text != ref.text and len(mismatches) < 5:
                    mismatches.append(
                        {
                            "contender": LABELS[key],
                            "round": run.round,
                            "workload": run.workload,
                            "prompt": i,
                            "got": a.text,
                            "single_instance": ref.text,
                        }
                    )
        out(
            f"| {LABELS[key]} | {n} | {errs} | {same_other}/{n} | {same_ref}/{n} "
            f"| {prompt_tokens:,} | {kv:,.0f} | {moved}/{len(runs)} |"
        )
        data["correctness"][LABELS[key]] = {
            "requests": n,
            "errors": errs,
            "match_other": same_other,
            "match_single_instance": same_ref,
            "prompt_tokens": prompt_tokens,
            "kv_tokens": kv,
            "runs": len(runs),
            "runs_kv_moved": moved,
            "error_notes": [a.error for run in runs for a in run.answers if a.error][:5],
        }
    data["mismatches"] = mismatches
    data["xhpc_handoffs"] = res.handoffs
    data["warmup_errors"] = res.warmup_errors
    out("")
    out(
        f"xhpc proxy's own /metrics over the rounds: "
        f"{res.handoffs.get('true', 0):.0f} handoffs with P's kv_transfer_params, "
        f"{res.handoffs.get('false', 0):.0f} without. The single instance: the same engine "
        f"flags without a KV connector, asked directly (non-streaming) for every prompt."
    )
    for m in mismatches:
        out(f"Mismatch: {m}")
    return Summary("\n".join(lines), data)
