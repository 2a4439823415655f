"""The rounds' figures to the table, pure: per condition (quiet, hostile) the median of the
rounds' p50 and p99 with [min, max]; the hostile round's p99 over the quiet round before it,
round by round (median [min, max]); the requests done and the errors; what the hostile tenants
did and got; the three targets; and the figures ``--json`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench._common import Summary, med, spread

from .tenants import OPS

TARGET_RATIO = 2.0
KINDS = ("quiet", "hostile")
STREAMS = ("chat", "health")
CLASSES = ("200", "429", "4xx", "5xx", "failed")


def of(rounds: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in rounds if r["kind"] == kind]


def ratios(rounds: Sequence[dict[str, Any]], stream: str, figure: str) -> list[float]:
    """Each hostile round's ``figure`` over the quiet round's before it (NaN: not measured)."""
    out = []
    for quiet, hostile in zip(of(rounds, "quiet"), of(rounds, "hostile"), strict=False):
        q, h = quiet[stream][figure], hostile[stream][figure]
        out.append(h / q if q == q and h == h and q > 0 else float("nan"))
    return out


def times(values: Sequence[float]) -> str:
    """``1.23x [1.01, 1.50]``: the median ratio with [min, max]; ``n/a`` for none."""
    text = spread(values, scale=1.0, digits=2)
    if text == "-":
        return "n/a"
    head, _, rest = text.partition(" ")
    return f"{head}x {rest}".strip()


def tenant_counts(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per hostile call, its answers by class summed over the hostile rounds."""
    total: dict[str, dict[str, int]] = {op: dict.fromkeys(CLASSES, 0) for op in OPS}
    for r in of(rounds, "hostile"):
        for op, counts in (r.get("tenants") or {}).get("ops", {}).items():
            for cls, n in counts.items():
                row = total.setdefault(op, dict.fromkeys(CLASSES, 0))
                row[cls] = row.get(cls, 0) + n
    return total


def summarize(rounds: Sequence[dict[str, Any]], params: dict[str, Any]) -> Summary:
    data: dict[str, Any] = {"params": params, "rounds": list(rounds)}
    rows = [
        "| condition | rounds | chat p50 ms | chat p99 ms | health p50 ms | health p99 ms | "
        "chat p99 vs quiet | health p99 vs quiet | requests done (chat / health) | "
        "errors (chat / health) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratio = {f"{s}_{f}": ratios(rounds, s, f) for s in STREAMS for f in ("p50", "p99")}
    data["ratios"] = ratio
    for kind in KINDS:
        mine = of(rounds, kind)
        cells, figures = [], {}
        for stream in STREAMS:
            for fig in ("p50", "p99"):
                values = [r[stream][fig] for r in mine]
                cells.append(spread(values))
                figures[f"{stream}_{fig}"] = med(values)
        done = {s: sum(r[s]["done"] for r in mine) for s in STREAMS}
        errors = {s: sum(r[s]["errors"] for r in mine) for s in STREAMS}
        figures.update(done=done, errors=errors)
        data[kind] = figures
        vs = ["1.00x", "1.00x"] if kind == "quiet" else [
            times(ratio["chat_p99"]), times(ratio["health_p99"])]  # fmt: skip
        rows.append(
            f"| {kind} | {len(mine)} | {' | '.join(cells)} | {' | '.join(vs)} | "
            f"{done['chat']} / {done['health']} | {errors['chat']} / {errors['health']} |"
        )
    rows.append(
        f"\np50 under hostile load vs quiet: chat {times(ratio['chat_p50'])}, "
        f"health {times(ratio['health_p50'])}"
    )
    rows += tenant_rows(rounds, data)
    server_errors = sum(r[s]["server_errors"] for r in rounds for s in STREAMS)
    data["server_errors"] = server_errors
    data["targets"] = [
        ratio_target("chat p99 under hostile load <= 2x quiet", ratio["chat_p99"]),
        ratio_target("broker health p99 under hostile load <= 2x quiet", ratio["health_p99"]),
        {"target": "no 5xx for the third key and the broker", "value": str(server_errors),
         "met": server_errors == 0},
    ]  # fmt: skip
    rows.append("")
    rows += [f"target: {t['target']}: {t['value']} ({'met' if t['met'] else 'NOT met'})"
             for t in data["targets"]]  # fmt: skip
    return Summary("\n".join(rows), data)


def ratio_target(name: str, values: list[float]) -> dict[str, Any]:
    m = med(values)
    return {"target": name, "value": times(values), "met": bool(m == m and m <= TARGET_RATIO)}


def tenant_rows(rounds: Sequence[dict[str, Any]], data: dict[str, Any]) -> list[str]:
    """What the hostile tenants did during the hostile rounds, per call."""
    hostile = [r.get("tenants") or {} for r in of(rounds, "hostile")]
    seconds = sum(t.get("seconds", 0.0) for t in hostile)
    cpu_s = sum(t.get("cpu_s", 0.0) for t in hostile)
    mib = sum(t.get("uploaded_bytes", 0) for t in hostile) / (1 << 20)
    counts = tenant_counts(rounds)
    calls = sum(sum(c.values()) for op, c in counts.items() if "64 MiB" not in op)
    data["tenants"] = {"seconds": seconds, "cpu_s": cpu_s, "uploaded_mib": mib,
                       "flood_calls": calls, "ops": counts}  # fmt: skip
    rate = (lambda x: x / seconds) if seconds > 0 else (lambda _x: float("nan"))
    out = [
        f"\nhostile tenants, {seconds:.0f} s in all: uploaded {mib:.0f} MiB of 64 MiB files "
        f"({rate(mib):.1f} MiB/s); flood {calls} calls ({rate(calls):.1f}/s)",
        "",
        "| hostile call | 200 | 429 | other 4xx | 5xx | no answer |",
        "|---|---|---|---|---|---|",
    ]
    for op, c in counts.items():
        out.append(f"| {op} | " + " | ".join(str(c.get(cls, 0)) for cls in CLASSES) + " |")
    return out
