"""The measurement: requests as the load generator sends them (bench/_http.py), a non-streaming
run (latency quantiles, requests per second) and a streaming one (TTFT, inter-event gaps, and
per stream the event count, the final [DONE], the body byte for byte), each with the garbage
collector off, a smoke test and warm-up per contender, and the interleaved rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import _http

from .launch import Setup, Target
from .params import HOST, KEYS, LABELS, MODEL, Params, log


def chat_body(stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def request_bytes(stream: bool, key: str, path: str = "/v1/chat/completions") -> bytes:
    headers = {"Authorization": f"Bearer {key}"}
    return _http.build_request(path, chat_body(stream), host=HOST, headers=headers)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Plain:
    """One non-streaming run."""

    p50: float
    p99: float
    rps: float
    n: int
    errors: int
    notes: list[str]


@dataclass
class Sse:
    """One streaming run."""

    ttft_p50: float
    itl_p99: float
    streams: int
    events_ok: int
    done_ok: int
    exact: int
    errors: int
    event_counts: list[int]
    notes: list[str]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_plain(
    to: Target, conns: int, warm_s: float, dur_s: float, path: str = "/v1/chat/completions"
) -> Plain:
    port = to.port
    req = request_bytes(False, to.key, path)

    async def go() -> _http.Job:
        job = _http.Job(req, warm_s=warm_s, dur_s=dur_s)
        await _http.run_job(HOST, port, conns, job, timeout_s=warm_s + dur_s + 15)
        return job

    with no_gc():
        job = asyncio.run(go())
    lat = job.latencies
    return Plain(
        quantile(lat, 0.5), quantile(lat, 0.99), job.completed / dur_s, len(lat), job.errors,
        job.error_notes,
    )  # fmt: skip


def run_sse(to: Target, conns: int, per_conn: int, expected: list[bytes]) -> Sse:
    port = to.port
    req = request_bytes(True, to.key)
    exp_body = b"".join(expected)

    async def go() -> _http.Job:
        job = _http.Job(req, stream=True, per_conn=per_conn)
        prime = request_bytes(False, to.key)  # warm connections, as a client's pool has
        await _http.run_job(HOST, port, conns, job, timeout_s=per_conn * 1.0 + 20, prime=prime)
        return job

    with no_gc():
        job = asyncio.run(go())
    ttfts = [s.ttft for s in job.streams if s.ttft is not None]
    gaps = [g for s in job.streams for g in s.gaps()]
    counts = [len(_http.split_events(bytes(s.body))) for s in job.streams]
    done = sum(
        1
        for s in job.streams
        if (ev := _http.split_events(bytes(s.body))) and ev[-1].strip() == _http.DONE_EVENT
    )
    exact = sum(1 for s in job.streams if bytes(s.body) == exp_body)
    return Sse(
        ttft_p50=quantile(ttfts, 0.5),
        itl_p99=quantile(gaps, 0.99),
        streams=len(job.streams),
        events_ok=sum(1 for c in counts if c == len(expected)),
        done_ok=done,
        exact=exact,
        errors=job.errors + (conns * per_conn - len(job.streams)),
        event_counts=sorted(set(counts)),
        notes=job.error_notes,
    )


def smoke(key: str, to: Target, expected: list[bytes], warm_s: float) -> None:
    """A few answers and a stream through the contender, then ``warm_s`` of c=1 load to warm
    it up, before any timing."""
    job = _http.Job(request_bytes(False, to.key), per_conn=5)
    with no_gc():
        asyncio.run(_http.run_job(HOST, to.port, 1, job, timeout_s=30))
    if job.errors or job.completed != 5:
        raise RuntimeError(f"{LABELS[key]}: chat requests failed: {job.error_notes}")
    sse = run_sse(to, 1, 1, expected)
    if sse.errors or sse.streams != 1:
        raise RuntimeError(f"{LABELS[key]}: a streamed chat request failed: {sse.notes}")
    run_plain(to, 1, 0.0, warm_s)


WORKLOADS = ("c1", "c64", "sse1", "sse32")


@dataclass
class Results:
    keys: list[str]
    plain: dict[str, dict[str, list[Plain]]] = field(default_factory=dict)  # wl -> key -> rounds
    sse: dict[str, dict[str, list[Sse]]] = field(default_factory=dict)
    ceiling: dict[str, list[Plain]] = field(default_factory=dict)  # c1/c64 vs nginx static


def run_rounds(setup: Setup, p: Params, expected: list[bytes]) -> Results:
    keys = [k for k in KEYS if k in setup.ports]
    res = Results(keys)
    for wl in ("c1", "c64"):
        res.plain[wl] = {k: [] for k in keys}
    for wl in ("sse1", "sse32"):
        res.sse[wl] = {k: [] for k in keys}
    for key in keys:
        smoke(key, setup.target(key), expected, p.warm_s * 2)
    for r in range(p.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        t0 = time.monotonic()
        for wl in WORKLOADS:
            for key in order:
                to = setup.target(key)
                if wl == "c1":
                    res.plain[wl][key].append(run_plain(to, 1, p.warm_s, p.c1_s))
                elif wl == "c64":
                    res.plain[wl][key].append(run_plain(to, 64, p.warm_s, p.c64_s))
                elif wl == "sse1":
                    res.sse[wl][key].append(run_sse(to, 1, p.sse1_streams, expected))
                else:
                    res.sse[wl][key].append(run_sse(to, 32, p.sse32_per_conn, expected))
        if "nginx" in setup.ports:  # what the load generator alone can do (nginx's `return 200`)
            for wl, conns in (("c1", 1), ("c64", 64)):
                dur = p.c1_s if conns == 1 else p.c64_s
                static = setup.target("nginx")
                run = run_plain(static, conns, p.warm_s, dur / 2, "/bench-static")
                res.ceiling.setdefault(wl, []).append(run)
        log(f"round {r + 1}/{p.rounds} done in {time.monotonic() - t0:.1f}s (order {order})")
    return res
