"""The measured traffic: the third key's chat completions through the gateway and the broker's
``GET /v1/health`` over its control socket, each sent at a fixed pace (open loop: a slow answer
does not delay the next request), with every answer's latency and status kept.

A request's latency runs from just before it is sent to its whole answer read. Latency
percentiles are of the 200s; any other status, or no answer within ``TIMEOUT_S`` (status 0),
is an error, and a 5xx or no answer is a server error.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

TIMEOUT_S = 30.0
NO_ANSWER = 0  # the status noted for a request that got no answer


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 1) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Samples:
    """One kind of request in one round: the latencies of its 200s and every status seen."""

    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def note(self, status: int, latency_s: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200:
            self.latencies.append(latency_s)

    def figures(self) -> dict[str, Any]:
        """What a round keeps of it (seconds; counts)."""
        sent = sum(self.statuses.values())
        return {
            "p50": percentile(self.latencies, 0.50),
            "p99": percentile(self.latencies, 0.99),
            "done": sent - self.statuses.get(NO_ANSWER, 0),
            "errors": sent - self.statuses.get(200, 0),
            "server_errors": sum(n for s, n in self.statuses.items() if s >= 500 or s == 0),
            "statuses": {str(s): n for s, n in sorted(self.statuses.items())},
        }


async def paced(
    send: Callable[[], Awaitable[int]], interval_s: float, seconds: float, samples: Samples
) -> None:
    """``send`` every ``interval_s`` for ``seconds``, each on its own task (a late loop skips
    ahead, never bursts), then wait for the answers still out."""
    loop = asyncio.get_running_loop()
    out: set[asyncio.Task[None]] = set()

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            status = await asyncio.wait_for(send(), TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError, OSError):
            status = NO_ANSWER
        samples.note(status, time.perf_counter() - t0)

    start = loop.time()
    next_at = start
    while next_at < start + seconds:
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one())
        out.add(task)
        task.add_done_callback(out.discard)
        next_at = max(next_at + interval_s, loop.time())
    if out:
        await asyncio.wait(set(out), timeout=TIMEOUT_S + 1)


class Meter:
    """The two measured streams, on kept-alive connections opened once for the whole run."""

    def __init__(self, gateway: str, key: str, model: str, broker_socket: Path) -> None:
        self.url = f"{gateway}/v1/chat/completions"
        self.body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ).encode()
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.broker_socket = broker_socket
        self.gateway: aiohttp.ClientSession | None = None
        self.broker: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Meter:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        self.gateway = aiohttp.ClientSession(timeout=timeout)
        connector = aiohttp.UnixConnector(path=str(self.broker_socket))
        self.broker = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *_: object) -> None:
        for session in (self.gateway, self.broker):
            if session is not None:
                await session.close()

    async def chat(self) -> int:
        assert self.gateway is not None
        async with self.gateway.post(self.url, data=self.body, headers=self.headers) as resp:
            await resp.read()
            return resp.status

    async def health(self) -> int:
        assert self.broker is not None
        async with self.broker.get("http://broker/v1/health") as resp:
            await resp.read()
            return resp.status

    async def round(
        self, seconds: float, chat_every_s: float, health_every_s: float
    ) -> dict[str, Any]:
        """One round of both streams side by side: each one's figures."""
        chat, health = Samples(), Samples()
        await asyncio.gather(
            paced(self.chat, chat_every_s, seconds, chat),
            paced(self.health, health_every_s, seconds, health),
        )
        return {"chat": chat.figures(), "health": health.figures()}
