"""What each READY engine says of its own load (its Prometheus ``/metrics``), for the
autoscaler: requests running and waiting, KV-cache use, and the time to first token.

``parse`` reads vLLM's exposition (pure); ``EngineScrapes`` asks every READY vLLM replica, with
its engine secret, in the background of the reconcile pass (2 s per engine at most, all at
once), and keeps the last answer of each. A time to first token is a histogram: the p90 of the
requests between two scrapes is read from the difference of its buckets.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from xhpc.broker.watch.engine_calls import EngineCalls
from xhpc.models import EngineKind, ReplicaState
from xhpc.records import ReplicaRecord

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
MAX_BYTES = 4 << 20
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USE = "vllm:kv_cache_usage_perc"
TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_use: float | None = None
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


def _sample(line: str) -> tuple[str, dict[str, str], float] | None:
    """One exposition line as (name, labels, value); None for comments and odd lines."""
    if not line or line.startswith("#"):
        return None
    head, _, rest = line.rpartition(" ")
    if not head:
        return None
    try:
        value = float(rest)
    except ValueError:
        return None
    labels: dict[str, str] = {}
    name = head
    if "{" in head and head.endswith("}"):
        name, _, inner = head[:-1].partition("{")
        for part in inner.split(","):
            k, _, v = part.partition("=")
            if k:
                labels[k.strip()] = v.strip().strip('"')
    return name.strip(), labels, value


def parse(text: str) -> EngineLoad:
    """vLLM's exposition: the sums over its label sets (one engine may report several)."""
    running = waiting = 0.0
    kv: float | None = None
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        got = _sample(line)
        if got is None:
            continue
        name, labels, value = got
        if math.isnan(value):
            continue
        if name == RUNNING:
            running += value
        elif name == WAITING:
            waiting += value
        elif name == KV_USE:
            kv = value if kv is None else max(kv, value)
        elif name == TTFT + "_bucket":
            try:
                le = float(labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(le):
                buckets[le] = buckets.get(le, 0.0) + value
    return EngineLoad(running=running, waiting=waiting, kv_use=kv, ttft_buckets=buckets)


def ttft_p90(before: EngineLoad | None, after: EngineLoad) -> float | None:
    """The p90 time to first token of the requests between two scrapes (the upper bound of
    the bucket it falls in); None when none began."""
    les = sorted(after.ttft_buckets)
    if not les:
        return None
    old = before.ttft_buckets if before is not None else {}
    counts = [max(0.0, after.ttft_buckets[le] - old.get(le, 0.0)) for le in les]
    total = counts[-1]
    if total <= 0:
        return None
    for le, n in zip(les, counts, strict=True):
        if n >= 0.9 * total:
            return le if math.isfinite(le) else les[-2] if len(les) > 1 else None
    return None


class EngineScrapes:
    def __init__(self) -> None:
        self.last: dict[str, EngineLoad] = {}
        self.previous: dict[str, EngineLoad] = {}
        self._calls = EngineCalls(SCRAPE_TIMEOUT_S)

    async def close(self) -> None:
        await self._calls.close()

    def kick(self, rows: Iterable[ReplicaRecord]) -> None:
        """Scrape every READY vLLM engine in the background (skipped while the last runs)."""
        ready = [r for r in rows if r.state is ReplicaState.READY and r.host and r.port
                 and r.engine is EngineKind.VLLM]  # fmt: skip
        self._calls.start(lambda: self.scrape(ready))

    async def scrape(self, rows: list[ReplicaRecord]) -> None:
        got = await asyncio.gather(*(self._one(r) for r in rows))
        live = {r.replica_id for r in rows}
        for row, load in zip(rows, got, strict=True):
            if load is not None:
                if row.replica_id in self.last:
                    self.previous[row.replica_id] = self.last[row.replica_id]
                self.last[row.replica_id] = load
        for gone in set(self.last) - live:
            self.last.pop(gone, None)
            self.previous.pop(gone, None)

    async def _one(self, row: ReplicaRecord) -> EngineLoad | None:
        headers = {"Authorization": f"Bearer {row.engine_secret}"} if row.engine_secret else {}
        try:
            async with self._calls.session().get(
                f"http://{row.host}:{row.port}/metrics", headers=headers
            ) as resp:
                if resp.status != 200:
                    return None
                text = await resp.content.read(MAX_BYTES)
        except (aiohttp.ClientError, TimeoutError):
            return None
        return parse(text.decode(errors="replace"))

    def of(self, replica_ids: Iterable[str]) -> tuple[float, float, float | None, float | None]:
        """(running, waiting, fullest KV cache, worst recent p90 TTFT) over these replicas."""
        running = waiting = 0.0
        kv: float | None = None
        ttft: float | None = None
        for rid in replica_ids:
            load = self.last.get(rid)
            if load is None:
                continue
            running += load.running
            waiting += load.waiting
            if load.kv_use is not None:
                kv = load.kv_use if kv is None else max(kv, load.kv_use)
            p90 = ttft_p90(self.previous.get(rid), load)
            if p90 is not None:
                ttft = p90 if ttft is None else max(ttft, p90)
        return running, waiting, kv, ttft
