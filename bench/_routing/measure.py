"""The measurement: one streamed chat request (TTFT at the client, the replica that answered
from the chunks' model name), one run of a workload through xhpc's own gateway in this process
under one policy (prefix caches emptied first, their counters read before and after), the
calibration straight to each engine (cold vs cached prefill), and the interleaved rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from xhpc.models import Route, RoutingTable
from xhpc.proxy import Router, bound_url, make_app
from xhpc.proxy.forward import REPLICA_HEADER
from xhpc.settings import ProxyConfig, RoutingPolicyName

from .engines import Engine, engine_metrics, reset_prefix_caches
from .params import HOST, LABELS, MODEL, POLICIES, Params, log
from .workload import Messages, Workload, make_workload


@dataclass
class Answer:
    ttft: float | None  # seconds; None on error
    replica: str | None  # from the chunks' model name
    prompt_tokens: int | None
    error: str | None = None


async def stream_chat(
    client: aiohttp.ClientSession, url: str, model: str, msgs: Messages, max_tokens: int
) -> Answer:
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ttft = None
    served = None
    prompt_tokens = None
    t0 = time.perf_counter()
    try:
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return Answer(None, None, None, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            # through the proxy: the replica that answered; straight to an engine: its name
            served = resp.headers.get(REPLICA_HEADER)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Answer(None, served, None, f"stream error: {event['error']}")
                choices = event.get("choices") or []
                if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    prompt_tokens = event["usage"].get("prompt_tokens")
    except (aiohttp.ClientError, TimeoutError) as err:
        return Answer(None, served, None, f"{type(err).__name__}: {err}")
    if ttft is None:
        return Answer(None, served, prompt_tokens, "no content chunk")
    return Answer(ttft, served, prompt_tokens)


# --- one run: a workload through the proxy under one policy ------------------------------------


@dataclass
class Run:
    policy: str
    workload: str
    round: int
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    replicas_of: dict[int, list[str]] = field(default_factory=dict)  # session -> replicas used
    per_replica: dict[str, int] = field(default_factory=dict)
    hits: float = 0.0  # prefix-cache hit tokens, all engines, over the run
    queries: float = 0.0
    max_prompt_tokens: int = 0
    wall_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-min load average, start and end
    # each request: session, turn, replica, sent (s from the run's start), TTFT s, prompt tokens
    requests: list[tuple[int, int, str, float, float, int]] = field(default_factory=list)

    def q(self, quantile: float) -> float:
        return nearest_rank(self.ttfts, quantile)

    def split(self, replicas: int) -> str:
        """Sessions per replica, busiest first, e.g. "5/3" ("-" when a session moved)."""
        if self.sticky != len(self.replicas_of):
            return "-"
        homes = [0] * replicas
        for rs in self.replicas_of.values():
            homes[int(rs[0].removeprefix("r"))] += 1
        return "/".join(str(n) for n in sorted(homes, reverse=True))

    @property
    def sticky(self) -> int:
        """Sessions whose every turn went to one replica."""
        return sum(1 for rs in self.replicas_of.values() if len(set(rs)) == 1)


def nearest_rank(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@contextlib.asynccontextmanager
async def proxy(engines: list[Engine], policy: RoutingPolicyName) -> Any:
    routes = tuple(
        Route(model=MODEL, replica_id=e.name, url=e.url, served_model=e.served) for e in engines
    )
    config = ProxyConfig(routing=policy, auth="none")
    router = Router(RoutingTable(version=1, models=(MODEL,), routes=routes), config=config)
    runner = web.AppRunner(make_app(router), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, HOST, 0).start()
        yield bound_url(runner)
    finally:
        await runner.cleanup()


async def run_once(
    engines: list[Engine],
    client: aiohttp.ClientSession,
    wl: Workload,
    policy: RoutingPolicyName,
    rnd: int,
    p: Params,
) -> Run:
    reset_prefix_caches(engines)
    before = [engine_metrics(e) for e in engines]
    run = Run(LABELS[policy], wl.name, rnd)
    load0 = os.getloadavg()[0]
    done = {(k, t): asyncio.Event() for k, t in wl.order}
    todo = list(wl.order)
    t0 = time.perf_counter()
    async with proxy(engines, policy) as url:

        async def worker() -> None:
            while todo:
                k, t = todo.pop(0)
                if t > 0:
                    await done[(k, t - 1)].wait()
                msgs = wl.sessions[k].messages(t)
                sent = time.perf_counter() - t0
                ans = await stream_chat(client, url, MODEL, msgs, p.max_tokens)
                done[(k, t)].set()
                if ans.error is not None or ans.ttft is None:
                    run.errors.append(f"session {k} turn {t}: {ans.error}")
                    continue
                run.ttfts.append(ans.ttft)
                replica = ans.replica or "?"
                run.replicas_of.setdefault(k, []).append(replica)
                run.per_replica[replica] = run.per_replica.get(replica, 0) + 1
                run.max_prompt_tokens = max(run.max_prompt_tokens, ans.prompt_tokens or 0)
                run.requests.append((k, t, replica, sent, ans.ttft, ans.prompt_tokens or 0))

        await asyncio.gather(*(worker() for _ in range(p.concurrency)))
    run.wall_s = time.perf_counter() - t0
    run.load = (load0, os.getloadavg()[0])
    after = [engine_metrics(e) for e in engines]
    for b, a in zip(before, after, strict=True):
        run.hits += a.get("vllm:prefix_cache_hits_total", 0.0) - b.get(
            "vllm:prefix_cache_hits_total", 0.0
        )
        run.queries += a.get("vllm:prefix_cache_queries_total", 0.0) - b.get(
            "vllm:prefix_cache_queries_total", 0.0
        )
    return run


# --- calibration: cold vs cached prefill, straight to each engine -------------------------------


@dataclass
class Calibration:
    cold: list[float] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)
    cold_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


async def calibrate(
    engines: list[Engine], client: aiohttp.ClientSession, p: Params, seed: int
) -> Calibration:
    cal = Calibration()
    # warm-up: each engine's first requests pay one-off costs
    warm = make_workload("warm-up", seed - 1, len(engines), p)
    for i, e in enumerate(engines):
        for t in range(2):
            ans = await stream_chat(client, e.url, e.served, warm.sessions[i].messages(t), 2)
            if ans.error:
                raise RuntimeError(f"engine {e.name}: warm-up request failed: {ans.error}")
    wl = make_workload("calibration", seed, p.calibration * len(engines), p)
    for i, e in enumerate(engines):
        for j in range(p.calibration):
            s = wl.sessions[i * p.calibration + j]
            cold = await stream_chat(client, e.url, e.served, s.messages(0), p.max_tokens)
            cached = await stream_chat(client, e.url, e.served, s.messages(1), p.max_tokens)
            for ans in (cold, cached):
                if ans.error or ans.ttft is None:
                    raise RuntimeError(f"engine {e.name}: calibration failed: {ans.error}")
            assert cold.ttft is not None and cached.ttft is not None
            cal.cold.append(cold.ttft)
            cal.cached.append(cached.ttft)
            cal.cold_tokens.append(cold.prompt_tokens or 0)
            cal.cached_tokens.append(cached.prompt_tokens or 0)
    return cal


# --- rounds ------------------------------------------------------------------------------------


async def run_all(
    engines: list[Engine], p: Params, workloads: list[tuple[str, int]]
) -> tuple[Calibration, list[Run]]:
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        cal = await calibrate(engines, client, p, seed=900_000)
        runs: list[Run] = []
        for rnd in range(p.rounds):
            for name, sessions in workloads:
                wl = make_workload(name, 1000 * (rnd + 1) + sessions, sessions, p)
                order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    run = await run_once(engines, client, wl, policy, rnd, p)
                    log(
                        f"round {rnd + 1}/{p.rounds} {name} {LABELS[policy]}: "
                        f"p50 {run.q(0.5) * 1e3:.0f} ms, p90 {run.q(0.9) * 1e3:.0f} ms, "
                        f"hit {100 * run.hits / max(run.queries, 1):.0f}%, "
                        f"{run.sticky}/{len(run.replicas_of)} sessions on one replica "
                        f"(split {run.split(p.replicas)}), {len(run.errors)} errors, "
                        f"{run.wall_s:.1f}s, load average {run.load[0]:.1f}-{run.load[1]:.1f}"
                    )
                    runs.append(run)
    return cal, runs
