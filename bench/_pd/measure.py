"""The measurement: prompts per (round, workload), distinct everywhere and the same for both
contenders; one request, plain or streamed, with its latency, TTFT, text and usage; a closed
loop over a list of prompts; the decode instance's KV-transfer counter and the xhpc proxy's
handoff counter; and the run: the single instance's reference answers, a warm-up, then the
interleaved rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench._common import Procs

from .launch import Setup
from .params import HOST, KEYS, KV_COUNTER, KV_SOURCE, MODEL, WORKLOADS, Params, log

TEXT = (
    "the cluster schedules jobs across nodes while each engine reads its prompt and writes "
    "tokens back to the client through a proxy that knows which replica holds which prefix of "
    "every long document so that a second request finds the blocks already computed and only "
    "the new question costs time on the accelerator memory bandwidth decides decode speed while "
    "compute bounds prefill for long inputs a heterogeneous job starts both halves together or "
    "not at all and the network carries the key value cache between them over tcp or rdma"
)
WORDS = TEXT.split()


def make_prompts(p: Params, seed: int = 2026) -> dict[tuple[int, str], list[str]]:
    """Prompts per (round, workload): distinct everywhere, the same for both contenders."""
    rng = random.Random(seed)
    out: dict[tuple[int, str], list[str]] = {}
    for r in range(-1, p.rounds):  # round -1: warm-up
        for wl in WORKLOADS:
            n = p.c1_prompts if wl.concurrency == 1 else p.c4_prompts
            out[(r, wl.key)] = [
                f"Request {r + 1}.{wl.key}.{i}: "
                + " ".join(rng.choice(WORDS) for _ in range(p.prompt_words))
                for i in range(n)
            ]
    return out


def chat_body(prompt: str, p: Params, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": p.max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Answer:
    latency: float = float("nan")
    ttft: float | None = None
    text: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False  # streams: the final data: [DONE] arrived
    error: str | None = None


async def ask(
    session: aiohttp.ClientSession, port: int, prompt: str, p: Params, stream: bool
) -> Answer:
    ans = Answer()
    body = chat_body(prompt, p, stream)
    t0 = time.perf_counter()
    try:
        async with session.post(f"http://{HOST}:{port}/v1/chat/completions", json=body) as resp:
            if not stream:
                raw = await resp.read()
                ans.latency = time.perf_counter() - t0
                if resp.status != 200:
                    ans.error = f"HTTP {resp.status}: {raw[:200]!r}"
                    return ans
                data = json.loads(raw)
                ans.text = data["choices"][0]["message"]["content"]
                usage = data.get("usage") or {}
                ans.prompt_tokens = usage.get("prompt_tokens")
                ans.completion_tokens = usage.get("completion_tokens")
                return ans
            if resp.status != 200:
                raw = await resp.read()
                ans.latency = time.perf_counter() - t0
                ans.error = f"HTTP {resp.status}: {raw[:200]!r}"
                return ans
            parts: list[str] = []
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk.replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data_s = line[5:].strip()
                        if data_s == b"[DONE]":
                            ans.done = True
                            continue
                        obj = json.loads(data_s)
                        if "error" in obj:
                            ans.error = f"error event: {str(obj['error'])[:200]}"
                        for choice in obj.get("choices") or ():
                            piece = (choice.get("delta") or {}).get("content")
                            if piece:
                                if ans.ttft is None:
                                    ans.ttft = time.perf_counter() - t0
                                parts.append(piece)
                        if obj.get("usage"):
                            ans.prompt_tokens = obj["usage"].get("prompt_tokens")
                            ans.completion_tokens = obj["usage"].get("completion_tokens")
            ans.latency = time.perf_counter() - t0
            ans.text = "".join(parts)
            if not ans.done and ans.error is None:
                ans.error = "stream ended without data: [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as err:
        ans.latency = time.perf_counter() - t0
        ans.error = f"{type(err).__name__}: {err}"[:300]
    return ans


async def run_prompts(
    session: aiohttp.ClientSession,
    port: int,
    prompts: list[str],
    p: Params,
    concurrency: int,
    stream: bool,
) -> list[Answer]:
    """Closed loop: ``concurrency`` workers, each sends the next prompt once its answer is in."""
    answers: list[Answer] = [Answer() for _ in prompts]
    todo = iter(range(len(prompts)))

    async def worker() -> None:
        for i in todo:
            answers[i] = await ask(session, port, prompts[i], p, stream)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


async def kv_tokens(session: aiohttp.ClientSession, port: int) -> float:
    """The decode instance's prompt tokens taken from the KV transfer, so far."""
    async with session.get(f"http://{HOST}:{port}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(KV_COUNTER + "{") and KV_SOURCE in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def pd_handoffs(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """xhpc proxy's handoffs by kv_params (true: P returned kv_transfer_params)."""
    async with session.get(f"http://{HOST}:{port}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("xhpc_proxy_pd_handoffs_total{"):
            kind = "true" if 'kv_params="true"' in line else "false"
            out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Run:
    """One workload through one contender in one round."""

    round: int
    workload: str
    contender: str
    answers: list[Answer]
    kv_tokens: float  # the decode instance's counter, after - before


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)
    reference: dict[tuple[int, str], list[Answer]] = field(default_factory=dict)
    handoffs: dict[str, float] = field(default_factory=dict)
    warmup_errors: list[str] = field(default_factory=list)

    def run(self, r: int, wl: str, key: str) -> Run:
        for run in self.runs:
            if (run.round, run.workload, run.contender) == (r, wl, key):
                return run
        raise KeyError((r, wl, key))


async def measure(setup: Setup, p: Params, procs: Procs) -> Results:
    res = Results()
    prompts = make_prompts(p)
    timeout = aiohttp.ClientTimeout(total=120)
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            k: await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))
            for k in (*KEYS, "plain")
        }
        # the single instance's answers to every prompt (direct, not timed), then it goes
        t0 = time.monotonic()
        for (r, wl_key), texts in prompts.items():
            if r >= 0:
                res.reference[(r, wl_key)] = await run_prompts(
                    sessions["plain"], setup.plain, texts, p, 4, False
                )
        bad = [a.error for rs in res.reference.values() for a in rs if a.error]
        if bad:
            raise RuntimeError(f"the single instance failed {len(bad)} prompts: {bad[:3]}")
        log(f"single-instance answers in {time.monotonic() - t0:.1f}s; stopping it")
        procs.stop("plain")

        # warm-up: each contender once through every workload (round -1), not measured
        for wl in WORKLOADS:
            for key in KEYS:
                answers = await run_prompts(
                    sessions[key], setup.ports[key], prompts[(-1, wl.key)][:4], p,
                    wl.concurrency, wl.stream,
                )  # fmt: skip
                res.warmup_errors += [f"{key} {wl.key}: {a.error}" for a in answers if a.error]
        if res.warmup_errors:
            log(f"warm-up errors: {res.warmup_errors[:3]}")
        before = await pd_handoffs(sessions["xhpc"], setup.ports["xhpc"])

        for r in range(p.rounds):
            order = KEYS if r % 2 == 0 else KEYS[::-1]
            t0 = time.monotonic()
            for wl in WORKLOADS:
                for key in order:
                    kv0 = await kv_tokens(sessions[key], setup.decode)
                    answers = await run_prompts(
                        sessions[key], setup.ports[key], prompts[(r, wl.key)], p,
                        wl.concurrency, wl.stream,
                    )  # fmt: skip
                    await asyncio.sleep(0.05)  # let the engine's last stats land
                    kv1 = await kv_tokens(sessions[key], setup.decode)
                    res.runs.append(Run(r, wl.key, key, answers, kv1 - kv0))
            log(f"round {r + 1}/{p.rounds} done in {time.monotonic() - t0:.1f}s (order {order})")
        after = await pd_handoffs(sessions["xhpc"], setup.ports["xhpc"])
        res.handoffs = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("true", "false")}
    return res
