"""Figures to the table: per contender and phase, the median [min, max] over the runs that
answered; per contender, its difference to plain sbatch round by round, then the median; the
two targets; and the figures ``--json`` writes. Works on the runs' records (dicts, as
``--json`` writes them), so it is tested from recorded figures without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench._common import Summary, med, spread

from .params import KEYS, LABELS, PHASE_LABELS, PHASES, TARGET_XHPC_VS_PLAIN_S

Record = Mapping[str, Any]
BASE = "plain"
TARGET_PLAIN = (
    f"xhpc serve → first answer through the proxy within {TARGET_XHPC_VS_PLAIN_S:g} s of plain "
    "sbatch (median)"
)
TARGET_VEC_INF = "xhpc ahead of vec-inf (median)"


def answered(r: Record) -> bool:
    return r["error"] is None and r["first_200_s"] is not None and r["round"] >= 0


def values(runs: Sequence[Record], key: str, phase: str) -> list[float]:
    """The phase's seconds in every answered run of ``key``."""
    return [
        float(r[phase])
        for r in runs
        if r["contender"] == key and answered(r) and r[phase] is not None
    ]


def paired(runs: Sequence[Record], key: str, base: str, phase: str) -> list[float]:
    """``key`` minus ``base`` for the phase, in each round where both answered."""
    by = {(r["contender"], r["round"]): r for r in runs if answered(r)}
    out = []
    for (who, rnd), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        other = by.get((base, rnd))
        if who == key and other is not None and None not in (r[phase], other[phase]):
            out.append(float(r[phase]) - float(other[phase]))
    return out


def count(runs: Sequence[Record], key: str) -> tuple[int, int]:
    """(answered, measured) runs of ``key``, the warm-up left out."""
    mine = [r for r in runs if r["contender"] == key and r["round"] >= 0]
    return sum(answered(r) for r in mine), len(mine)


def _number(x: float) -> float | None:
    return None if math.isnan(x) else x


def _target(target: str, diffs: list[float], met: bool, than: str) -> dict[str, Any]:
    if not diffs:
        return {"target": target, "value": "not measured (no round where both answered)",
                "met": False}  # fmt: skip
    value = f"{med(diffs):+.2f} s ({than}, median of {len(diffs)} rounds)"
    return {"target": target, "value": value, "met": met}


def targets(runs: Sequence[Record]) -> list[dict[str, Any]]:
    """xhpc - plain sbatch <= 0.5 s, and xhpc - vec-inf < 0, launch -> first answer, each the
    median of the round-by-round differences."""
    vs_plain = paired(runs, "xhpc", "plain", "first_200_s")
    vs_vec_inf = paired(runs, "xhpc", "vec-inf", "first_200_s")
    return [
        _target(
            TARGET_PLAIN, vs_plain, bool(vs_plain) and med(vs_plain) <= TARGET_XHPC_VS_PLAIN_S,
            "xhpc - plain sbatch",
        ),
        _target(
            TARGET_VEC_INF, vs_vec_inf, bool(vs_vec_inf) and med(vs_vec_inf) < 0,
            "xhpc - vec-inf",
        ),
    ]  # fmt: skip


def phase_row(runs: Sequence[Record], phase: str) -> str:
    cells = [spread(values(runs, k, phase), scale=1.0, digits=2) for k in KEYS]
    diffs = [spread(paired(runs, k, BASE, phase), scale=1.0, digits=2, sign="+") for k in KEYS[1:]]
    label = PHASE_LABELS[phase]
    if phase == "first_200_s":
        label = f"**{label}**"
    return f"| {label} | " + " | ".join(cells + diffs) + " |"


def table_lines(runs: Sequence[Record]) -> list[str]:
    head = [LABELS[k] for k in KEYS] + [f"{LABELS[k]} - {LABELS[BASE]}" for k in KEYS[1:]]
    lines = [
        "| phase, s since the launch command started | " + " | ".join(head) + " |",
        "|---" * (len(head) + 1) + "|",
    ]
    lines += [phase_row(runs, phase) for phase in PHASES]
    counts = [f"{a}/{n}" for a, n in (count(runs, k) for k in KEYS)]
    lines.append("| answered | " + " | ".join(counts + [""] * (len(KEYS) - 1)) + " |")
    return lines


def target_lines(found: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| target | value | met |", "|---|---|---|"]
    lines += [
        f"| {t['target']} | {t['value']} | {'yes' if t['met'] else '**no**'} |" for t in found
    ]
    return lines


def failure_lines(runs: Sequence[Record]) -> list[str]:
    bad = [r for r in runs if r["error"] is not None or r.get("left_jobs")]
    lines = []
    for r in bad:
        where = "warm-up" if r["round"] < 0 else f"round {r['round']}"
        what = r["error"] or "answered"
        if r.get("left_jobs"):
            what += f"; still in squeue after its stop: {', '.join(r['left_jobs'])}"
        lines.append(f"- {where}, {LABELS[r['contender']]} (job {r['job_id'] or '?'}): {what}")
    return lines


def intro(params: Mapping[str, Any]) -> list[str]:
    follow = params.get("xhpc_follow")
    xhpc = "`xhpc serve`, then chat requests" if follow else "`xhpc serve --detach`"
    plain = "`vllm serve`" if params.get("plain_vllm_serve") else "xhpc's `python -m` form"
    return [
        f"## Launch -> first answer: plain sbatch, vec-inf {params.get('vec_inf', '?')}, "
        "xhpc serve (the same vLLM job)",
        "",
        f"{params.get('rounds', '?')} interleaved rounds, the order rotated each round; one poll "
        f"loop for all three (squeue until RUNNING, then a one-token chat completion, every "
        f"{params.get('poll_s', '?')} s). Plain sbatch runs vLLM in {plain}; xhpc: {xhpc}, "
        "answered through the proxy. Seconds since the launch command started, median [min, "
        "max] over the runs that answered; '- plain sbatch': the contender minus plain sbatch "
        "in the same round, then the median.",
        "",
    ]


def figures(runs: Sequence[Record]) -> dict[str, Any]:
    return {
        "median_s": {k: {p: _number(med(values(runs, k, p))) for p in PHASES} for k in KEYS},
        "diff_to_plain_s": {
            k: {p: _number(med(paired(runs, k, BASE, p))) for p in PHASES} for k in KEYS[1:]
        },
        "answered": {k: list(count(runs, k)) for k in KEYS},
    }


def summarize(runs: Sequence[Record], params: Mapping[str, Any]) -> Summary:
    """The table, the targets and any failed run; the figures and targets for ``--json``."""
    found = targets(runs)
    lines = [*intro(params), *table_lines(runs), "", "### Targets", "", *target_lines(found)]
    failed = failure_lines(runs)
    if failed:
        lines += ["", "### Runs that did not answer or left a job", "", *failed]
    data: dict[str, Any] = {
        "contenders": dict(LABELS),
        "params": dict(params),
        "runs": [dict(r) for r in runs],
        **figures(runs),
        "targets": found,
    }
    return Summary("\n".join(lines), data)
