"""Figures to the table: medians of the round values with [min, max], added latency per round
against direct, ratios of the medians, the three tables (non-streaming, SSE, the xhpc proxy
against the others), the targets (docs/performance.md) and the figures ``--json`` writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench._common import Summary, med
from bench._common import spread as _spread

from .launch import Cores, Setup
from .measure import Results, Sse
from .params import (
    LABELS,
    TARGET_ADDED_P50_MS,
    TARGET_ITL_ADDED_MS,
    TARGET_RPS,
    TARGET_TTFT_1_MS,
    TARGET_TTFT_32_MS,
    TARGET_VS_LITELLM,
    Params,
)


def spread(values: list[float], scale: float = 1e3, digits: int = 3) -> str:
    return _spread(values, scale, digits)


def rps_spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{med(values):,.0f} [{min(values):,.0f}, {max(values):,.0f}]"


def added(runs: list[Any], base: list[Any], attr: str) -> list[float]:
    return [getattr(a, attr) - getattr(b, attr) for a, b in zip(runs, base, strict=True)]


def times(x: float, y: float) -> str:
    """x / y as a ratio string."""
    if y <= 0 or x != x or y != y:
        return "n/a"
    return f"{x / y:.2f}x"


def less(proxy: float, other: float) -> str:
    """How many times less `proxy` adds than `other` (both added latencies)."""
    if other != other or proxy != proxy:
        return "n/a"
    if proxy <= 0:
        return "inf (the proxy adds <= 0)"
    return f"{other / proxy:.1f}x less"


def summarize(res: Results, setup: Setup, p: Params, cores: Cores, tokens: int) -> Summary:
    keys = res.keys
    lines: list[str] = []
    data: dict[str, Any] = {"contenders": [LABELS[k] for k in keys], "params": p.__dict__}
    out = lines.append
    d_c1, d_c64 = res.plain["c1"]["direct"], res.plain["c64"]["direct"]
    out(
        f"## Gateway overhead, {p.rounds} interleaved rounds "
        f"(median of rounds [min, max]; added = contender - direct, round by round)"
    )
    out("")
    out(f"Cores: {cores.describe()}.")
    vers = ", ".join(f"{k} {v}" for k, v in setup.versions.items())
    if vers:
        out(f"Versions: {vers}.")
    for note in setup.notes:
        out(f"Note: {note}.")
    out("")
    out("### Non-streaming chat completions, keep-alive, closed loop")
    out("")
    out(
        "| contender | c=1 p50 ms | c=1 added p50 ms | c=1 added p99 ms | c=64 RPS "
        "| c=64 added p50 ms | c=64 added p99 ms | errors |"
    )
    out("|---|---|---|---|---|---|---|---|")
    data["plain"] = {}
    for k in keys:
        c1, c64 = res.plain["c1"][k], res.plain["c64"][k]
        errs = sum(r.errors for r in c1 + c64)
        if k == "direct":
            a50 = a99 = b50 = b99 = "—"
        else:
            a50 = spread(added(c1, d_c1, "p50"))
            a99 = spread(added(c1, d_c1, "p99"))
            b50 = spread(added(c64, d_c64, "p50"))
            b99 = spread(added(c64, d_c64, "p99"))
        out(
            f"| {LABELS[k]} | {spread([r.p50 for r in c1])} | {a50} | {a99} "
            f"| {rps_spread([r.rps for r in c64])} | {b50} | {b99} | {errs} |"
        )
        data["plain"][LABELS[k]] = {
            "c1_p50_ms": med([r.p50 for r in c1]) * 1e3,
            "c1_added_p50_ms": med(added(c1, d_c1, "p50")) * 1e3,
            "c1_added_p99_ms": med(added(c1, d_c1, "p99")) * 1e3,
            "c64_rps": med([r.rps for r in c64]),
            "c64_added_p50_ms": med(added(c64, d_c64, "p50")) * 1e3,
            "c64_added_p99_ms": med(added(c64, d_c64, "p99")) * 1e3,
            "errors": errs,
            "error_notes": [n for r in c1 + c64 for n in r.notes][:5],
        }
    if res.ceiling:
        c1s, c64s = res.ceiling.get("c1", []), res.ceiling.get("c64", [])
        out("")
        out(
            f"Load generator (one core): {rps_spread([r.rps for r in c1s])} RPS at c=1 and "
            f"{rps_spread([r.rps for r in c64s])} RPS at c=64 against nginx's static "
            f"`return 200` on the other core; {rps_spread([r.rps for r in d_c1])} / "
            f"{rps_spread([r.rps for r in d_c64])} RPS against the backend directly "
            f"(client and backend sharing its core). A contender near these is limited by "
            f"the load generator, not by itself."
        )
        data["loadgen"] = {
            "static_c1_rps": med([r.rps for r in c1s]),
            "static_c64_rps": med([r.rps for r in c64s]),
            "direct_c1_rps": med([r.rps for r in d_c1]),
            "direct_c64_rps": med([r.rps for r in d_c64]),
        }

    n_events = tokens + 3
    out("")
    out(
        f"### Streaming (SSE): {tokens} tokens = {n_events} events incl. usage and [DONE], "
        f"one every {p.interval_ms:g} ms from the backend"
    )
    out("")
    out(
        "| contender | streams | TTFT p50 ms | TTFT added p50 ms | ITL p99 ms | ITL p99 added ms "
        "| event count = sent | final [DONE] | byte-exact | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    data["sse"] = {}
    for wl, label in (("sse1", "1"), ("sse32", "32")):
        d = res.sse[wl]["direct"]
        for k in keys:
            runs = res.sse[wl][k]
            n = sum(r.streams for r in runs)
            ok = sum(r.events_ok for r in runs)
            done = sum(r.done_ok for r in runs)
            exact = sum(r.exact for r in runs)
            errs = sum(r.errors for r in runs)
            counts = sorted({c for r in runs for c in r.event_counts})
            ttft_add = "—" if k == "direct" else spread(added(runs, d, "ttft_p50"))
            itl_add = "—" if k == "direct" else spread(added(runs, d, "itl_p99"))
            shown_counts = "" if ok == n else f" (got {counts})"
            out(
                f"| {LABELS[k]} | {label} | {spread([r.ttft_p50 for r in runs])} | {ttft_add} "
                f"| {spread([r.itl_p99 for r in runs])} | {itl_add} | {ok}/{n}{shown_counts} "
                f"| {done}/{n} | {exact}/{n} | {errs} |"
            )
            data["sse"].setdefault(wl, {})[LABELS[k]] = {
                "streams": n,
                "events_match": ok,
                "done": done,
                "byte_exact": exact,
                "errors": errs,
                "event_counts": counts,
                "expected_events": n_events,
                "ttft_p50_ms": med([r.ttft_p50 for r in runs]) * 1e3,
                "ttft_added_p50_ms": med(added(runs, d, "ttft_p50")) * 1e3,
                "itl_p99_ms": med([r.itl_p99 for r in runs]) * 1e3,
                "itl_added_p99_ms": med(added(runs, d, "itl_p99")) * 1e3,
            }

    if "xhpc" in keys:
        out("")
        out("### The xhpc proxy against the others (ratios of the medians above)")
        out("")
        out("| measure | xhpc proxy | vs direct | vs nginx | vs LiteLLM |")
        out("|---|---|---|---|---|")
        x_c1 = med(added(res.plain["c1"]["xhpc"], d_c1, "p50"))
        x_c64a = med(added(res.plain["c64"]["xhpc"], d_c64, "p50"))
        x_rps = med([r.rps for r in res.plain["c64"]["xhpc"]])
        d_rps = med([r.rps for r in d_c64])

        def other(key: str, f: Callable[[str], float]) -> float:
            return f(key) if key in keys else float("nan")

        def c1_added(key: str) -> float:
            return med(added(res.plain["c1"][key], d_c1, "p50"))

        def c64_added(key: str) -> float:
            return med(added(res.plain["c64"][key], d_c64, "p50"))

        def rps(key: str) -> float:
            return med([r.rps for r in res.plain["c64"][key]])

        def vs_added(x: float, key: str, f: Callable[[str], float]) -> str:
            o = other(key, f)
            if o != o:
                return "n/a"
            return f"{times(x, o)} nginx's" if key == "nginx" else less(x, o)

        out(
            f"| added p50, c=1 | {x_c1 * 1e3:.3f} ms | +{x_c1 * 1e3:.3f} ms "
            f"| {vs_added(x_c1, 'nginx', c1_added)} | {vs_added(x_c1, 'litellm', c1_added)} |"
        )
        out(
            f"| added p50, c=64 | {x_c64a * 1e3:.3f} ms | +{x_c64a * 1e3:.3f} ms "
            f"| {vs_added(x_c64a, 'nginx', c64_added)} "
            f"| {vs_added(x_c64a, 'litellm', c64_added)} |"
        )
        out(
            f"| RPS, c=64 | {x_rps:,.0f} | {times(x_rps, d_rps)} "
            f"| {times(x_rps, other('nginx', rps))} | {times(x_rps, other('litellm', rps))} |"
        )
        for wl, streams in (("sse1", "1 stream"), ("sse32", "32 streams")):
            base = res.sse[wl]["direct"]

            def ttft_added(key: str, wl: str = wl, base: list[Sse] = base) -> float:
                return med(added(res.sse[wl][key], base, "ttft_p50"))

            x_t = ttft_added("xhpc")
            out(
                f"| SSE TTFT added p50, {streams} | {x_t * 1e3:.3f} ms | +{x_t * 1e3:.3f} ms "
                f"| {vs_added(x_t, 'nginx', ttft_added)} "
                f"| {vs_added(x_t, 'litellm', ttft_added)} |"
            )
        lite_c1 = other("litellm", c1_added)
        x_sse = data["sse"]
        checks = [
            (
                f"added p50 at c=1 ≤ {TARGET_ADDED_P50_MS} ms",
                f"{x_c1 * 1e3:.3f} ms",
                x_c1 * 1e3 <= TARGET_ADDED_P50_MS,
            ),
            (
                f"≥ {TARGET_RPS:,.0f} RPS on one core at c=64",
                f"{x_rps:,.0f} RPS" + (" (pinned)" if cores.proxy is not None else " (unpinned)"),
                x_rps >= TARGET_RPS,
            ),
            (
                f"≥ {TARGET_VS_LITELLM:.0f}x less added latency than LiteLLM (c=1 p50)",
                less(x_c1, lite_c1) if lite_c1 == lite_c1 else "n/a (no LiteLLM)",
                lite_c1 == lite_c1 and (x_c1 <= 0 or lite_c1 / x_c1 >= TARGET_VS_LITELLM),
            ),
            (
                f"SSE TTFT added ≤ {TARGET_TTFT_1_MS} ms (1 stream)",
                f"{x_sse['sse1']['xhpc proxy']['ttft_added_p50_ms']:.3f} ms",
                x_sse["sse1"]["xhpc proxy"]["ttft_added_p50_ms"] <= TARGET_TTFT_1_MS,
            ),
            (
                f"SSE TTFT added p50 ≤ {TARGET_TTFT_32_MS} ms (32 streams)",
                f"{x_sse['sse32']['xhpc proxy']['ttft_added_p50_ms']:.3f} ms",
                x_sse["sse32"]["xhpc proxy"]["ttft_added_p50_ms"] <= TARGET_TTFT_32_MS,
            ),
            (
                f"SSE ITL p99 within +{TARGET_ITL_ADDED_MS} ms (1 / 32 streams)",
                f"{x_sse['sse1']['xhpc proxy']['itl_added_p99_ms']:+.3f} / "
                f"{x_sse['sse32']['xhpc proxy']['itl_added_p99_ms']:+.3f} ms",
                max(
                    x_sse["sse1"]["xhpc proxy"]["itl_added_p99_ms"],
                    x_sse["sse32"]["xhpc proxy"]["itl_added_p99_ms"],
                )
                <= TARGET_ITL_ADDED_MS,
            ),
            (
                "SSE: same event count, final [DONE], byte-exact (every stream)",
                "; ".join(
                    f"{n}: {x['events_match']}/{x['streams']} counts, {x['done']} [DONE], "
                    f"{x['byte_exact']} byte-exact"
                    for w, n in (("sse1", "1 stream"), ("sse32", "32 streams"))
                    for x in (x_sse[w]["xhpc proxy"],)
                ),
                all(
                    x_sse[w]["xhpc proxy"][m] == x_sse[w]["xhpc proxy"]["streams"]
                    for w in ("sse1", "sse32")
                    for m in ("events_match", "done", "byte_exact")
                ),
            ),
        ]
        out("")
        out("### Targets")
        out("")
        out("| target | xhpc proxy | met |")
        out("|---|---|---|")
        for what, value, ok in checks:
            out(f"| {what} | {value} | {'yes' if ok else '**no**'} |")
        data["targets"] = [{"target": w, "value": v, "met": bool(ok)} for w, v, ok in checks]
    return Summary("\n".join(lines), data)
