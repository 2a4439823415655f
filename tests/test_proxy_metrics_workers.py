"""/metrics with several proxy workers (decision 0010): every scrape answers for the whole
gateway, whichever worker it reaches, and no counter ever goes back — not when a worker is
killed with -9, not when a reload replaces them all.

In one process first (``ProxyMetrics`` objects sharing a directory stand for the workers,
``RetiredMetrics`` for the supervisor), then with the real process tree of
tests/test_proxy_workers.py: `xhpc proxy --workers 2` over bench/_backend.py on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import stat
import time
from pathlib import Path

import aiohttp
import pytest

from tests.test_proxy_gateway import Samples, parse_metrics, value
from tests.test_proxy_workers import CHAT, HEADERS, REQUEST_TIMEOUT, START_S, process_tree, until
from xhpc.models import RoutingTable
from xhpc.proxy import metrics as metrics_module
from xhpc.proxy.metrics import (
    RETIRED_FILE,
    ProxyMetrics,
    RetiredMetrics,
    SharedMetrics,
    write_private,
)
from xhpc.proxy.process.supervisor import metrics_dir
from xhpc.proxy.routes.routing import Router

REQUESTS = "xhpc_proxy_requests_total"
LATENCY = "xhpc_proxy_request_duration_seconds"


def routed(*replicas: str) -> Router:
    router = Router()
    routes = [
        {
            "model": "m",
            "replica_id": rid,
            "url": f"http://127.0.0.1:{9000 + i}",
            "served_model": "m",
        }
        for i, rid in enumerate(replicas)
    ]
    router.update(RoutingTable.model_validate({"version": 1, "models": ["m"], "routes": routes}))
    return router


def total(samples: Samples, name: str = REQUESTS) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


class Worker:
    """A worker's metrics and router, in this process; ``pid`` is its ``worker`` label."""

    def __init__(self, directory: Path, name: str, pid: int) -> None:
        self.router = routed("r0", "r1")
        self.metrics = ProxyMetrics()
        self.metrics.share(directory, name)
        assert self.metrics.shared is not None
        self.metrics.shared.pid = pid
        self.name = name

    def serve(self, n: int = 1, duration_s: float = 0.1) -> None:
        for _ in range(n):
            self.metrics.request("m", "r0", 200, duration_s)

    def scrape(self) -> Samples:
        return parse_metrics(self.metrics.render(self.router))


def test_a_scrape_of_either_worker_answers_for_both(tmp_path: Path) -> None:
    a, b = Worker(tmp_path, "w1", 101), Worker(tmp_path, "w2", 102)
    a.serve(3)
    b.serve(2, duration_s=1.0)
    b.metrics.usage("m", 5, 7)
    a.router.acquire(a.router.table.routes[0])
    b.router.acquire(b.router.table.routes[0])
    for _ in range(5):
        b.router.failed(b.router.table.routes[1])  # b's breaker for r1 opens
    b.metrics.publish(b.router)
    for samples in (a.scrape(), b.scrape()):
        assert value(samples, REQUESTS, model="m", replica="r0", status="200") == 5
        assert value(samples, f"{LATENCY}_count", model="m") == 5
        assert value(samples, f"{LATENCY}_sum", model="m") == pytest.approx(2.3)
        assert value(samples, f"{LATENCY}_bucket", model="m", le="0.1") == 3
        assert value(samples, "xhpc_proxy_tokens_total", model="m", kind="completion") == 7
        assert value(samples, "xhpc_proxy_in_flight", replica="r0") == 2  # summed
        assert value(samples, "xhpc_proxy_in_flight", replica="r1") == 0
        assert value(samples, "xhpc_proxy_breaker_state", replica="r1", worker="101") == 0
        assert value(samples, "xhpc_proxy_breaker_state", replica="r1", worker="102") == 1
        assert value(samples, "xhpc_proxy_breaker_ejections_total", replica="r1") == 1
        assert value(samples, "xhpc_proxy_ready_replicas", model="m") == 2  # not summed


def test_one_process_renders_as_before_without_a_worker_label() -> None:
    metrics, router = ProxyMetrics(), routed("r0")
    metrics.request("m", "r0", 200, 0.1)
    text = metrics.render(router)
    assert 'xhpc_proxy_breaker_state{replica="r0"} 0\n' in text
    assert "worker=" not in text
    assert value(parse_metrics(text), REQUESTS, model="m", replica="r0", status="200") == 1


def test_an_exited_workers_counts_stay_and_its_gauges_go(tmp_path: Path) -> None:
    retired = RetiredMetrics(tmp_path)
    a, b = Worker(tmp_path, "w1", 101), Worker(tmp_path, "w2", 102)
    a.serve(3)
    b.serve(4)
    b.router.acquire(b.router.table.routes[1])
    b.metrics.publish(b.router)  # its last figures, at exit
    retired.absorb("w2")
    assert not (tmp_path / "w2.json").exists()
    samples = a.scrape()
    assert total(samples) == 7
    assert value(samples, "xhpc_proxy_in_flight", replica="r1") == 0
    assert ("xhpc_proxy_breaker_state", frozenset({("replica", "r0"), ("worker", "102")})) not in (
        samples
    )
    c = Worker(tmp_path, "w3", 103)  # its replacement
    c.serve(2)
    assert total(c.scrape()) == total(a.scrape()) == 9
    mode = stat.S_IMODE((tmp_path / RETIRED_FILE).stat().st_mode)
    assert mode == 0o600


def test_a_worker_folded_in_during_a_scrape_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    retired = RetiredMetrics(tmp_path)
    a, b, c = (Worker(tmp_path, f"w{i}", 100 + i) for i in (1, 2, 3))
    for n, worker in enumerate((a, b, c), start=1):
        worker.serve(n)
        worker.metrics.publish(worker.router)
    retired.absorb("w3")
    # the supervisor between writing retired.json and removing the file: both there
    kept = (tmp_path / "w2.json").read_bytes()
    retired.absorb("w2")
    write_private(tmp_path / "w2.json", kept)
    assert total(a.scrape()) == 6
    (tmp_path / "w2.json").unlink()
    # the supervisor folds w2 in while the scrape lists the directory: read again
    b2 = Worker(tmp_path, "w4", 104)
    b2.serve(10)
    b2.metrics.publish(b2.router)
    listdir = os.listdir
    calls = []

    def racing(path: str | os.PathLike[str]) -> list[str]:
        names = listdir(path)
        if not calls:
            retired.absorb("w4")  # the listing above still names w4.json; it is gone now
        calls.append(path)
        return names

    monkeypatch.setattr(metrics_module.os, "listdir", racing)
    assert total(a.scrape()) == 16
    assert len(calls) == 2


def test_counters_never_go_back_whichever_worker_answers(tmp_path: Path) -> None:
    """Random traffic, scrapes of random workers, workers exiting and replaced: every scrape's
    count is the last one's or more, the latency sum too (exact sums: no rounding goes back),
    and after each scrape of every worker the count is every request served."""
    rng = random.Random(7)
    retired = RetiredMetrics(tmp_path)
    names = iter(f"w{i}" for i in range(1, 1000))
    live = [Worker(tmp_path, next(names), 100 + i) for i in range(3)]
    served, last_count, last_sum = 0, 0.0, 0.0
    for step in range(600):
        worker = rng.choice(live)
        roll = rng.random()
        if roll < 0.6:
            n = rng.randint(1, 3)
            worker.serve(n, duration_s=rng.random() / 7)
            served += n
        elif roll < 0.7:
            worker.metrics.publish(worker.router)  # its periodic publication
        elif roll < 0.75 and step > 10:
            if rng.random() < 0.5:
                worker.metrics.publish(worker.router)  # an orderly exit publishes; kill -9 not
            live.remove(worker)
            retired.absorb(worker.name)
            live.append(Worker(tmp_path, next(names), 200 + step))
        else:
            samples = worker.scrape()
            count = total(samples)
            latency_sum = total(samples, f"{LATENCY}_sum")
            assert count >= last_count and latency_sum >= last_sum, step
            last_count, last_sum = count, latency_sum
    for worker in live:
        worker.scrape()  # each publishes what it holds
    lost = served - total(live[0].scrape())
    assert lost >= 0
    for worker in live:
        assert total(worker.scrape()) == served - lost


def test_sums_are_exact_so_no_rounding_makes_one_go_back(tmp_path: Path) -> None:
    """Float sums depend on their order: (1e16 + 1) + 1 == 1e16, 1e16 + (1 + 1) == 1e16 + 2.
    The workers' figures are added exactly, also once in retired.json, so every scrape says the
    same whichever worker answers and whichever exited."""
    retired = RetiredMetrics(tmp_path)
    big, one, two = (Worker(tmp_path, f"w{i}", 100 + i) for i in (1, 2, 3))
    big.serve(duration_s=1e16)
    one.serve(duration_s=1.0)
    two.serve(duration_s=1.0)
    for worker in (big, one, two):
        worker.metrics.publish(worker.router)
    want = 1e16 + 2
    for worker in (big, one, two):
        assert value(worker.scrape(), f"{LATENCY}_sum", model="m") == want
    retired.absorb("w1")
    retired.absorb("w2")
    assert value(two.scrape(), f"{LATENCY}_sum", model="m") == want


def test_unknown_or_damaged_snapshots_are_left_out(tmp_path: Path) -> None:
    a = Worker(tmp_path, "w1", 101)
    a.serve(2)
    (tmp_path / "w7.json").write_text("{not json")
    (tmp_path / "w8.json").write_text(json.dumps({"v": 99, "counters": {REQUESTS: []}}))
    damaged = {
        "v": 1,
        "pid": 9,
        "counters": {
            REQUESTS: [
                [["m", "r0", "200"], 5],
                [["m", "r0"], 100],  # labels of another arity
                [["m", "r0", 200], 100],  # not strings
                [["m", "r0", "200"], "100"],  # not a number
            ],
        },
        "histograms": {LATENCY: [[["m"], [1, 2], 0.5], [["m"], "x", 1]]},  # other buckets
        "in_flight": {"r0": "x"},
        "breakers": [],
    }
    (tmp_path / "w9.json").write_text(json.dumps(damaged))
    (tmp_path / ".w1.json.123.tmp").write_text("a write cut short")
    samples = a.scrape()
    assert value(samples, REQUESTS, model="m", replica="r0", status="200") == 7
    assert value(samples, f"{LATENCY}_count", model="m") == 2


def test_snapshots_are_private_and_written_only_when_changed(tmp_path: Path) -> None:
    directory = metrics_dir()
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        a = Worker(directory, "w1", 101)
        a.serve()
        a.metrics.publish(a.router)
        path = directory / "w1.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        inode = path.stat().st_ino
        a.metrics.publish(a.router)
        a.scrape()
        assert path.stat().st_ino == inode  # unchanged: not written again
        a.serve()
        a.scrape()
        assert path.stat().st_ino != inode
        assert [p.name for p in directory.iterdir()] == ["w1.json"]
    finally:
        shutil.rmtree(directory)


def test_a_worker_that_cannot_publish_still_answers(tmp_path: Path) -> None:
    a = Worker(tmp_path / "gone", "w1", 101)
    a.serve(2)
    assert total(a.scrape()) == 2
    assert isinstance(a.metrics.shared, SharedMetrics)


# --- the real process tree ---


def worker_args(pid: int) -> dict[str, str]:
    """A worker's --metrics-dir and --metrics-name, from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return {
        key: argv[argv.index(key) + 1] for key in ("--metrics-dir", "--metrics-name") if key in argv
    }


def published(run_dir: Path) -> dict[str, float]:
    """Requests per worker, as each worker's snapshot file says now."""
    found = {}
    for path in run_dir.glob("w*.json"):
        try:
            snap = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        found[path.stem] = sum(v for _, v in snap["counters"].get(REQUESTS, []))
    return found


class Client:
    """Requests and scrapes, each on a connection of its own (so that they reach either
    worker); every scrape's count must be at least the last one's."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session
        self.last = (0.0, 0.0)
        self.scrapes = 0
        self.workers_seen: set[str] = set()

    async def send(self, n: int, conns: int = 4) -> int:
        left = list(range(n))

        async def loop() -> int:
            ok = 0
            while left:
                left.pop()
                async with self.session.post(
                    self.url + "/v1/chat/completions", data=CHAT, headers=HEADERS
                ) as resp:
                    body = await resp.read()
                    assert resp.status == 200, body[:300]
                    ok += 1
            return ok

        return sum(await asyncio.gather(*(loop() for _ in range(conns))))

    async def count(self) -> float:
        async with self.session.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            samples = parse_metrics(await resp.text())
        now = (total(samples), total(samples, f"{LATENCY}_sum"))
        assert now[0] >= self.last[0] and now[1] >= self.last[1], (self.last, now)
        self.last = now
        self.scrapes += 1
        for (name, labels), _ in samples.items():
            if name == "xhpc_proxy_breaker_state":
                self.workers_seen.update(v for k, v in labels if k == "worker")
        return now[0]

    async def until_count(self, want: int) -> None:
        deadline = time.monotonic() + START_S
        while (got := await self.count()) != want:
            assert got < want, f"counted {got} requests, {want} were sent"
            assert time.monotonic() < deadline, f"counted {got} requests, not {want}"
            await asyncio.sleep(0.05)

    async def scrape_while(self, task: asyncio.Task[int]) -> int:
        while not task.done():
            await self.count()
        return await task


async def test_metrics_of_two_workers_add_up_through_a_kill_and_a_reload(tmp_path: Path) -> None:
    """Either worker's /metrics counts every request, through a kill -9 and a reload; so does
    ``proxy.metrics_listen``, which the supervisor binds once: every worker (the reloaded ones
    too) serves /metrics there, with no key and nothing else."""
    with process_tree(tmp_path, tokens=4, interval_ms=5) as tree:
        workers = tree.workers()
        assert len(workers) == 2, tree.log_text()
        run_dir = Path(worker_args(min(workers))["--metrics-dir"])
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT, connector=connector) as session:
            client, scraper = Client(tree.url, session), Client(tree.metrics_url, session)
            assert tree.logged("proxy metrics (no key) on http://127.0.0.1:")
            async with session.post(
                tree.metrics_url + "/v1/chat/completions", data=CHAT, headers=HEADERS
            ) as resp:
                assert resp.status == 404
            # requests until both workers have answered some (as their snapshots say)
            sent = 0
            deadline = time.monotonic() + START_S
            while not (len(counts := published(run_dir)) == 2 and all(counts.values())):
                assert time.monotonic() < deadline, f"requests per worker: {counts}"
                sent += await client.send(20)
            await client.until_count(sent)
            for _ in range(20):
                assert await client.count() == sent
            assert client.workers_seen == {str(pid) for pid in workers}
            await scraper.until_count(sent)

            # kill -9 one worker: its counts stay; more requests while scraping
            victim = max(workers)
            name = worker_args(victim)["--metrics-name"]
            os.kill(victim, signal.SIGKILL)
            await until(lambda: victim not in tree.workers(), "the killed worker to be gone")
            sent += await client.scrape_while(asyncio.create_task(client.send(100)))
            await until(lambda: not (run_dir / f"{name}.json").exists(), "its counts kept")
            await until(lambda: len(tree.workers()) == 2, "a second worker again")
            sent += await client.send(50)
            await client.until_count(sent)

            # a reload replaces both: their last counts stay
            old = tree.workers()
            tree.proxy.send_signal(signal.SIGHUP)
            while tree.workers() & old or len(tree.workers()) != 2:
                sent += await client.scrape_while(asyncio.create_task(client.send(20)))
                assert tree.proxy.poll() is None, tree.log_text()
            await client.until_count(sent)
            for _ in range(10):
                assert await client.count() == sent
            assert (run_dir / RETIRED_FILE).exists()
            assert len(published(run_dir)) == 2
            await scraper.until_count(sent)  # the new workers serve the metrics listener
            assert client.scrapes > 40
    assert not run_dir.exists()  # the supervisor removed it when it stopped
