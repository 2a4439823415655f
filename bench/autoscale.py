"""Autoscaling on the dev Slurm cluster: one day of traffic, compressed to minutes, replayed
through the gateway to three deployments at once (docs/performance.md).

    fixed at peak   ``xhpc serve --replicas P``: as many replicas as the peak needs, all day
    fixed at 1      ``xhpc serve --replicas 1``
    xhpc            ``xhpc serve --min 0 --max P --target-inflight T --idle I --down-window D``:
                    the broker's policy, asleep when idle, woken by the first call

The engine is the `command` engine running tests/data/engines/echo_engine.py with ``--slots``
(``--slots`` streams answered at once per replica, the rest wait, as in an engine's batch) and
``--prefill-s`` before each stream's first chunk, after ``--start-s`` of start-up (a model's
load); a stream is ``--chunks`` chunks, 0.2 s apart.
So a replica's capacity is ``slots`` streams, and the time to first token (TTFT) of a call is
its prefill plus any wait for a slot: what a replica too few costs.

The day is compressed about 150 times, and so are the policy's windows: ``--idle`` 20 s,
``--down-window`` 20 s, and the site's ``[autoscale] smooth_s`` 10 s and ``trend_min_s`` 20 s
(30 s and 60 s by default), so that a ramp of the trace is as long against them as a morning's
is against the defaults.

The trace (``DAY``): a night's idle, a morning ramp to the peak, a midday lull, an afternoon
peak, an evening decline, and night again, as (seconds, calls per second) points joined by
straight lines, ``--scale`` times its length. Arrivals are a Poisson process of that rate
(seeded): the same calls, at the same moments, to each contender. Every answer is checked (a 200,
``--chunks`` data events, ``[DONE]``). A call held through a cold start is seen by its first
SSE comment (``: waiting for a replica of NAME (about N s)``): its estimate.

Figures: GPU-seconds over the trace (every second: replicas whose job holds its GPUs, i.e.
STARTING, READY or DRAINING, times their GPUs), TTFT percentiles of the calls that found a
replica awake (not held), failed calls, and each held call's wait for a replica (to the SSE
comment that one took it: ``: a replica of NAME is ready (held S s)``) against its estimate,
and its TTFT (that wait, plus any wait for one of the engine's slots).

Targets (``--json``): xhpc's GPU-seconds <= 0.6x fixed at peak's; xhpc's p99 TTFT of calls that
found a replica awake <= 1.2x fixed at peak's; 0 failed calls (xhpc); every held call answered,
its wait <= its estimate + 20 %.

    .venv/bin/python bench/autoscale.py [--scale 1.0] [--json FILE]

About 10 minutes at ``--scale 1``. Needs the dev cluster up (``scripts/dev-cluster up``).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, tests.conftest

from bench._common import logger, run_on_tiny_model, target_lines  # noqa: E402

log = logger("autoscale")
ECHO = ROOT / "tests" / "data" / "engines" / "echo_engine.py"
CONTENDERS = ("fixed at peak", "fixed at 1", "xhpc")
# A compressed day: (seconds from the start, calls per second), joined by straight lines.
DAY = (
    (0, 0.0), (120, 0.0),         # night
    (121, 0.2), (165, 1.4),       # morning ramp
    (225, 1.4),                   # peak
    (245, 0.3), (305, 0.3),       # lull
    (335, 1.2), (375, 1.2),       # afternoon peak
    (405, 0.0), (540, 0.0),       # evening, night
)  # fmt: skip
GPU_RATIO = 0.6
TTFT_RATIO = 1.2
HELD_SLACK = 0.2
TARGET_GPU = f"xhpc's GPU-seconds <= {GPU_RATIO}x fixed at peak's"
TARGET_TTFT = (
    f"xhpc's p99 TTFT of calls that found a replica awake <= {TTFT_RATIO}x fixed at peak's"
)
TARGET_FAILED = "0 failed calls (xhpc)"
TARGET_HELD = f"every held call answered, its wait for a replica <= its estimate + {HELD_SLACK:.0%}"
HOLDING = ("STARTING", "READY", "DRAINING")  # a replica whose job holds its GPUs
ESTIMATE = re.compile(r"^: waiting for a replica of .* \(about (\d+) s\)$")
READY = re.compile(r"^: a replica of .* is ready \(held [0-9.]+ s\)$")
SITE_TOML = """
[engines.command]
command = ["{python}", "{echo}", "--port", "{{port}}", "--served-model", "{{served_model}}",
           "--slots", "{slots}", "--prefill-s", "{prefill}", "--start-s", "{start}"]
startup_timeout_s = 120

[slurm]
cpus_per_replica = 1

[autoscale]
smooth_s = {smooth}
trend_min_s = {trend}
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the figures and targets here")
    ap.add_argument("--scale", type=float, default=1.0, help="the trace's length, times (1)")
    ap.add_argument("--peak", type=int, default=3, help="replicas at the peak (3)")
    ap.add_argument("--slots", type=int, default=2, help="streams a replica answers at once (2)")
    ap.add_argument("--target", type=float, default=1.0, help="--target-inflight (1)")
    ap.add_argument("--chunks", type=int, default=10, help="chunks per answer, 0.2 s each (10)")
    ap.add_argument("--prefill-s", type=float, default=0.1, help="before chunk 1 (0.1 s)")
    ap.add_argument("--start-s", type=float, default=8.0, help="the engine's load (8 s)")
    ap.add_argument("--idle-s", type=float, default=20.0, help="xhpc's --idle (20)")
    ap.add_argument("--down-window-s", type=float, default=20.0, help="--down-window (20)")
    ap.add_argument("--smooth-s", type=float, default=10.0, help="[autoscale] smooth_s (10)")
    ap.add_argument("--trend-min-s", type=float, default=20.0, help="[autoscale] trend_min_s (20)")
    ap.add_argument("--seed", type=int, default=7, help="the arrivals' seed (7)")
    args = ap.parse_args(argv)
    if min(args.scale, args.peak, args.slots, args.target, args.chunks) <= 0:
        ap.error("--scale, --peak, --slots, --target and --chunks must be positive")
    return args


# -- the trace (pure) -----------------------------------------------------------------------------
def rate_at(t: float, points: Sequence[tuple[float, float]] = DAY, scale: float = 1.0) -> float:
    """Calls per second at ``t`` s into the trace (straight lines between the points)."""
    for (t0, r0), (t1, r1) in itertools.pairwise(points):
        a, b = t0 * scale, t1 * scale
        if a <= t <= b:
            return r0 if b == a else r0 + (r1 - r0) * (t - a) / (b - a)
    return 0.0


def arrivals(
    seed: int, scale: float = 1.0, points: Sequence[tuple[float, float]] = DAY
) -> list[float]:
    """A Poisson process of the trace's rate (by thinning one of the peak rate)."""
    rng = random.Random(seed)
    top = max(r for _, r in points) or 1.0
    end = points[-1][0] * scale
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() * top < rate_at(t, points, scale):
            out.append(round(t, 3))


def gpu_seconds(samples: Sequence[tuple[float, int]], end: float) -> float:
    """The integral of the GPUs held (sampled ``(t, gpus)``, each held until the next sample)
    from the first sample to ``end``."""
    total = 0.0
    for (t0, n), (t1, _) in zip(samples, [*samples[1:], (end, 0)], strict=False):
        total += n * max(0.0, min(t1, end) - t0)
    return total


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank); NaN when none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# -- one call -------------------------------------------------------------------------------------
@dataclass
class Call:
    contender: str
    at: float  # planned, s from the trace's start
    sent: float = float("nan")
    ttft: float = float("nan")  # s from sent to the first data event
    took: float = float("nan")
    held: bool = False
    estimate_s: float | None = None  # the first comment's estimate, when held
    ready_s: float = float("nan")  # s from sent to the comment that a replica took it
    error: str = ""


def stream(port: int, model: str, chunks: int, call: Call, t0: float) -> None:
    """One streamed chat through the gateway, checked whole; ``call`` gets its figures."""
    call.sent = time.monotonic() - t0
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": chunks, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    events = 0
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            call.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        last = ""
        while True:
            line = resp.readline()
            if not line:
                break
            text = line.decode(errors="replace").rstrip("\r\n")
            if text.startswith(":") and events == 0:
                found = ESTIMATE.match(text)
                if found and not call.held:
                    call.held, call.estimate_s = True, float(found.group(1))
                elif READY.match(text):
                    call.ready_s = time.monotonic() - t0 - call.sent
            elif text.startswith("data:"):
                if events == 0:
                    call.ttft = time.monotonic() - t0 - call.sent
                events += 1
                last = text[5:].strip()
        call.took = time.monotonic() - t0 - call.sent
        if last != "[DONE]" or events != chunks + 1:
            call.error = f"{events} events, last {last[:120]!r}"
    except (OSError, http.client.HTTPException) as err:
        call.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()


# -- the run --------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Every second, the GPUs each deployment's replicas hold (GET /v1/replicas?all=1)."""

    def __init__(self, socket_path: Path, names: dict[str, str], t0: float) -> None:
        from xhpc.client.http import BrokerTransport

        super().__init__(daemon=True)
        self.client = BrokerTransport(socket_path, timeout_s=5.0)
        self.names, self.t0 = names, t0
        self.samples: dict[str, list[tuple[float, int]]] = {c: [] for c in names}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                rows = self.client.get("/v1/replicas?all=1")
            except Exception:  # the broker busy: this second keeps the last sample's count
                rows = None
            if rows is not None:
                for contender, name in self.names.items():
                    held = sum(max(1, len(r.get("gpus") or ()) or 1) for r in rows
                               if r["deployment"] == name and r["state"] in HOLDING)  # fmt: skip
                    self.samples[contender].append((began - self.t0, held))
            self.stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tests.conftest import own_xhpc

    tag = os.getpid()
    names = {c: f"as-{k}-{tag}" for c, k in zip(CONTENDERS, ("peak", "one", "auto"), strict=True)}
    toml = SITE_TOML.format(python=sys.executable, echo=ECHO, slots=args.slots,
                            prefill=args.prefill_s, start=args.start_s, smooth=args.smooth_s,
                            trend=args.trend_min_s)  # fmt: skip
    plan = arrivals(args.seed, args.scale)
    end = DAY[-1][0] * args.scale
    data: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"},
                            "trace_s": end, "calls_planned": len(plan)}  # fmt: skip
    with own_xhpc(ROOT / "models" / "tiny-llama", toml) as x:
        serve = ("serve", "tiny-llama", "--engine", "command", "--detach")
        try:
            x.run(*serve, "--name", names["fixed at peak"], "--replicas", str(args.peak))
            x.run(*serve, "--name", names["fixed at 1"])
            x.run(*serve, "--name", names["xhpc"], "--min", "0", "--max", str(args.peak),
                  "--target-inflight", f"{args.target:g}", "--idle", f"{args.idle_s:g}",
                  "--down-window", f"{args.down_window_s:g}")  # fmt: skip
            want = {names["fixed at peak"]: args.peak, names["fixed at 1"]: 1, names["xhpc"]: 1}
            _wait_ready(x, want)
            log(f"all READY; replaying {len(plan)} calls over {end:.0f} s to each of 3")
            t0 = time.monotonic()
            sampler = Sampler(x.state_dir / "broker.sock", names, t0)
            sampler.start()
            calls = _replay(x.proxy_port, names, plan, args.chunks, t0, end)
            sampler.stop.set()
            sampler.join(10)
        finally:
            for name in names.values():
                x.run("stop", name, check=False)
    data["calls"] = [asdict(c) for c in calls]
    data["gpu_samples"] = sampler.samples
    data["gpu_seconds"] = {c: gpu_seconds(s, end) for c, s in sampler.samples.items()}
    return data


def _wait_ready(x: Any, want: dict[str, int]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        rows = json.loads(x.run("ps", "--json").stdout)
        ready = {n: sum(r["deployment"] == n and r["state"] == "READY" for r in rows) for n in want}
        if all(ready[n] >= k for n, k in want.items()):
            return
        time.sleep(1.0)
    raise TimeoutError(f"not READY within 300 s: {ready}")


def _replay(port: int, names: dict[str, str], plan: Sequence[float], chunks: int, t0: float,
            end: float) -> list[Call]:  # fmt: skip
    """Each planned call, at its moment, to each contender; back at the trace's end, once all
    are answered."""
    calls: list[Call] = []
    threads: list[threading.Thread] = []
    for at in plan:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for contender, name in names.items():
            call = Call(contender, at)
            calls.append(call)
            t = threading.Thread(target=stream, args=(port, name, chunks, call, t0), daemon=True)
            t.start()
            threads.append(t)
    time.sleep(max(0.0, t0 + end - time.monotonic()))  # the trace's quiet tail
    for t in threads:
        t.join(330)
    return calls


# -- figures, targets, the table (pure) -----------------------------------------------------------
def figures(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in CONTENDERS:
        calls = [x for x in data.get("calls", []) if x["contender"] == c]
        awake = [x["ttft"] for x in calls if not x["held"] and not x["error"]]
        held = [x for x in calls if x["held"]]
        out[c] = {
            "calls": len(calls),
            "failed": sum(1 for x in calls if x["error"]),
            "gpu_seconds": data.get("gpu_seconds", {}).get(c, float("nan")),
            "ttft_p50": percentile(awake, 50),
            "ttft_p99": percentile(awake, 99),
            "held": len(held),
            "held_answered": sum(1 for x in held if not x["error"]),
            "held_worst": max(
                (x["ready_s"] / x["estimate_s"] for x in held if _waited(x)), default=None
            ),
            "held_waits": [round(x["ready_s"], 2) for x in held],
            "held_ttft": [round(x["ttft"], 2) for x in held],
            "held_estimates": [x["estimate_s"] for x in held],
        }
    return out


def _waited(call: dict[str, Any]) -> bool:
    """A held call answered, whose wait for a replica was seen (its last comment)."""
    return not call["error"] and bool(call["estimate_s"]) and call["ready_s"] == call["ready_s"]


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    f = figures(data)
    peak, auto = f["fixed at peak"], f["xhpc"]
    out: list[dict[str, Any]] = []
    gpu = auto["gpu_seconds"] / peak["gpu_seconds"] if peak["gpu_seconds"] else float("nan")
    out.append({"target": TARGET_GPU, "value": f"{gpu:.2f}x ({auto['gpu_seconds']:.0f} vs "
                f"{peak['gpu_seconds']:.0f})", "met": gpu <= GPU_RATIO})  # fmt: skip
    ttft = auto["ttft_p99"] / peak["ttft_p99"] if peak["ttft_p99"] else float("nan")
    out.append({"target": TARGET_TTFT, "value": f"{ttft:.2f}x ({auto['ttft_p99'] * 1e3:.0f} vs "
                f"{peak['ttft_p99'] * 1e3:.0f} ms)", "met": ttft <= TTFT_RATIO})  # fmt: skip
    out.append({"target": TARGET_FAILED, "value": f"{auto['failed']} of {auto['calls']}",
                "met": auto["calls"] > 0 and auto["failed"] == 0})  # fmt: skip
    worst = auto["held_worst"]
    all_answered = auto["held_answered"] == auto["held"] == len(auto["held_waits"])
    all_answered = all_answered and all(w == w for w in auto["held_waits"])
    value = (f"{auto['held_answered']} of {auto['held']} answered; worst wait "
             + ("-" if worst is None else f"{worst:.2f}x its estimate"))  # fmt: skip
    met = auto["held"] > 0 and all_answered and worst is not None and worst <= 1 + HELD_SLACK
    out.append({"target": TARGET_HELD, "value": value, "met": met})
    return out


def _ms(v: float) -> str:
    return "-" if v != v else f"{v * 1e3:.0f}"


def table(data: dict[str, Any]) -> str:
    f = figures(data)
    peak = f["fixed at peak"]
    lines = ["| figure | " + " | ".join(CONTENDERS) + " | xhpc / at peak |",
             "|---|---|---|---|---|"]  # fmt: skip

    def row(label: str, key: str, shown: Any, ratio: bool = False) -> None:
        vals = [shown(f[c][key]) for c in CONTENDERS]
        r = f["xhpc"][key] / peak[key] if ratio and peak[key] else None
        lines.append(
            f"| {label} | " + " | ".join(vals) + f" | {'' if r is None else f'{r:.2f}x'} |"
        )

    row("GPU-seconds", "gpu_seconds", lambda v: f"{v:.0f}", ratio=True)
    row("TTFT p50, awake (ms)", "ttft_p50", _ms, ratio=True)
    row("TTFT p99, awake (ms)", "ttft_p99", _ms, ratio=True)
    row("calls", "calls", str)
    row("failed", "failed", str)
    row("held (cold start)", "held", str)
    auto = f["xhpc"]
    pairs = ", ".join(
        f"{w:.1f}/{e:.0f}" for w, e in zip(auto["held_waits"], auto["held_estimates"], strict=True)
    )
    lines.append(f"| held: wait for a replica / estimate (s) | | | {pairs or '-'} | |")
    ttfts = ", ".join(f"{t:.1f}" for t in auto["held_ttft"])
    lines.append(f"| held: TTFT (s) | | | {ttfts or '-'} | |")
    lines.append("")
    lines += target_lines(data["targets"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_on_tiny_model("autoscale", args.json, lambda work: run(args, work), targets, table)


if __name__ == "__main__":
    sys.exit(main())
