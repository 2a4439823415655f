"""What each READY vLLM engine says in its Prometheus ``/metrics``: the autoscaler's figures
(requests running and waiting, KV-cache use, the time to first token) and every series it
exports, kept for the broker's federated exposition (``GET /v1/metrics``, decision 0036).

``EngineScrapes`` asks READY vLLM replicas, with their engine secret, in the background of the
reconcile pass (2 s per engine at most, all at once): those of autoscaled deployments at every
pass, the others every ``EVERY_S`` (a federated series needs no more, and an answer costs the
broker a parse); it keeps the last answer of each.

An engine is not trusted: its answer is read up to ``MAX_BYTES`` (a longer one is cut after its
last whole line), parsed by ``xhpc.prometheus``'s rules (a line that is not the format's is
dropped; label values are escaped again when written), and at most ``MAX_SERIES`` of its samples
are kept. Written out (``render``), each sample carries the replica's ``deployment``,
``replica``, ``job`` and ``node``; an engine's own labels of those names become
``exported_<name>``, and its families named ``xhpc_*`` (the broker's own) are left out. An
engine whose last answer is older than ``STALE_S`` is left out too; ``ages`` tells how old each
one is.

``load_of`` (pure) reads the autoscaler's figures: the sums over the engine's label sets (one
engine may report several). A time to first token is a histogram: the p90 of the requests
between two scrapes is read from the difference of its buckets.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import aiohttp

from xhpc.broker.watch.engine_calls import EngineCalls
from xhpc.clock import monotonic
from xhpc.models import EngineKind, ReplicaState
from xhpc.prometheus import Exposition, LabelPairs, Merge
from xhpc.prometheus import parse as parse_text
from xhpc.records import ReplicaRecord

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
MAX_BYTES = 4 << 20  # of one engine's answer
MAX_SERIES = 5000  # samples kept of one engine's answer
STALE_S = 60.0  # an engine's series are left out once its last answer is this old
EVERY_S = 10.0  # an engine the autoscaler does not read is asked this often
MAX_REQUESTS = 1e9  # a larger count of running or waiting requests is read as this
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USE = "vllm:kv_cache_usage_perc"
TTFT = "vllm:time_to_first_token_seconds"
WHERE = ("deployment", "replica", "job", "node")  # the labels each engine sample gets
OWN_PREFIX = "xhpc_"  # the broker's own families: never an engine's


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_use: float | None = None
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


@dataclass(frozen=True)
class Scrape:
    """One engine's last answer: when it came (monotonic s), where it runs (``WHERE``), what
    was kept of it, and how many of its lines were not."""

    at: float
    where: LabelPairs
    kept: Exposition
    load: EngineLoad


def where(row: ReplicaRecord) -> LabelPairs:
    values = (row.deployment, row.replica_id, row.job_id or "", row.node or "")
    return tuple(zip(WHERE, values, strict=True))


def load_of(exposition: Exposition) -> EngineLoad:
    """vLLM's figures in an exposition: the sums over its label sets (a value that is no
    finite number at or above 0 is left out: it would break the sums and the autoscaler)."""
    running = waiting = 0.0
    kv: float | None = None
    buckets: dict[float, float] = {}
    for sample in exposition.samples():
        name, value = sample.name, sample.value
        if not (math.isfinite(value) and value >= 0):
            continue
        if name == RUNNING:
            running += min(value, MAX_REQUESTS)
        elif name == WAITING:
            waiting += min(value, MAX_REQUESTS)
        elif name == KV_USE:
            kv = value if kv is None else max(kv, value)
        elif name == TTFT + "_bucket":
            try:
                le = float(sample.label("le") or "nan")
            except ValueError:
                continue
            if not math.isnan(le):
                buckets[le] = buckets.get(le, 0.0) + value
    return EngineLoad(running=running, waiting=waiting, kv_use=kv, ttft_buckets=buckets)


def parse(text: str) -> EngineLoad:
    """vLLM's figures in its exposition text."""
    return load_of(parse_text(text))


def whole_lines(body: bytes, limit: int) -> tuple[str, bool]:
    """``body`` as text, cut after its last whole line when it runs past ``limit`` bytes (a
    line cut short could read as another number); whether it was cut."""
    if len(body) <= limit:
        return body.decode(errors="replace"), False
    cut = body.rfind(b"\n", 0, limit + 1)
    return body[: max(0, cut + 1)].decode(errors="replace"), True


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
        self.scrapes: dict[str, Scrape] = {}  # each engine's last answer
        self.previous: dict[str, EngineLoad] = {}  # each engine's figures the time before
        self._asked: dict[str, float] = {}  # when each engine was last asked (monotonic s)
        self._calls = EngineCalls(SCRAPE_TIMEOUT_S)

    async def close(self) -> None:
        await self._calls.close()

    def kick(self, rows: Iterable[ReplicaRecord], eager: Collection[str] = ()) -> None:
        """Scrape READY vLLM engines in the background (skipped while the last pass runs): those
        of the ``eager`` deployments (the autoscaler's) every time, the others once every
        ``EVERY_S``."""
        now = monotonic()
        ready = [r for r in rows if r.state is ReplicaState.READY and r.host and r.port
                 and r.engine is EngineKind.VLLM]  # fmt: skip
        due = [r for r in ready if r.deployment in eager
               or now - self._asked.get(r.replica_id, -EVERY_S) >= EVERY_S]  # fmt: skip
        live = {r.replica_id for r in ready}
        if self._calls.start(lambda: self.scrape(due, live)):
            self._asked = {rid: at for rid, at in self._asked.items() if rid in live}
            self._asked.update((r.replica_id, now) for r in due)

    async def scrape(self, rows: list[ReplicaRecord], live: Collection[str] | None = None) -> None:
        """Ask each of ``rows``; forget the engines not in ``live`` (default: ``rows``)."""
        got = await asyncio.gather(*(self._one(r) for r in rows))
        kept = {r.replica_id for r in rows} if live is None else set(live)
        for row, scrape in zip(rows, got, strict=True):
            if scrape is not None:
                rid = row.replica_id
                if rid in self.scrapes:
                    self.previous[rid] = self.scrapes[rid].load
                self.scrapes[rid] = scrape
        for gone in set(self.scrapes) - kept:
            self.scrapes.pop(gone, None)
            self.previous.pop(gone, None)

    async def _one(self, row: ReplicaRecord) -> Scrape | None:
        headers = {"Authorization": f"Bearer {row.engine_secret}"} if row.engine_secret else {}
        try:
            async with self._calls.session().get(
                f"http://{row.host}:{row.port}/metrics", headers=headers
            ) as resp:
                if resp.status != 200:
                    return None
                body = await resp.content.read(MAX_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError):
            return None
        text, cut = whole_lines(body, MAX_BYTES)
        read = parse_text(text)
        kept = read.limited(MAX_SERIES)
        kept.dropped += cut
        return Scrape(at=monotonic(), where=where(row), kept=kept, load=load_of(read))

    def of(self, replica_ids: Iterable[str]) -> tuple[float, float, float | None, float | None]:
        """(running, waiting, fullest KV cache, worst recent p90 TTFT) over these replicas."""
        running = waiting = 0.0
        kv: float | None = None
        ttft: float | None = None
        for rid in replica_ids:
            scrape = self.scrapes.get(rid)
            if scrape is None:
                continue
            load = scrape.load
            running += load.running
            waiting += load.waiting
            if load.kv_use is not None:
                kv = load.kv_use if kv is None else max(kv, load.kv_use)
            p90 = ttft_p90(self.previous.get(rid), load)
            if p90 is not None:
                ttft = p90 if ttft is None else max(ttft, p90)
        return running, waiting, kv, ttft

    def fresh(self, now: float | None = None) -> dict[str, Scrape]:
        """The engines whose last answer is under ``STALE_S`` old."""
        now = monotonic() if now is None else now
        return {rid: s for rid, s in self.scrapes.items() if now - s.at < STALE_S}

    def ages(self, now: float | None = None) -> list[tuple[LabelPairs, float]]:
        """How old each engine's last answer is (s), with its ``deployment`` and ``replica``."""
        now = monotonic() if now is None else now
        return [(s.where[:2], max(0.0, now - s.at)) for s in self.scrapes.values()]

    def render(self, now: float | None = None) -> list[str]:
        """Every fresh engine's series, labelled where it runs, one family each (the module
        docstring)."""
        merge = Merge(reserved=lambda name: name.startswith(OWN_PREFIX))
        for _, scrape in sorted(self.fresh(now).items()):
            merge.add(scrape.kept.families.values(), scrape.where)
        return merge.lines()
