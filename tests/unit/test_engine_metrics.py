"""Each engine's own load, from its Prometheus exposition (``xhpc.broker.watch.engine_metrics``):
vLLM's gauges summed over label sets, the fullest KV cache, the p90 time to first token of the
requests between two scrapes (from the histogram's buckets); the scraper asks READY vLLM
engines only, with their secret, and an engine that does not answer is left out. Each
engine's series are kept (bounded) and written labelled where it runs; a hostile engine's
answer breaks neither the exposition nor the autoscaler's figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from tests.proxy_fakes import serve
from tests.test_proxy_gateway import value
from tests.unit.test_adapter_desk import _row
from tests.unit.test_prometheus_text import parse_metrics
from xhpc.broker.watch import engine_metrics
from xhpc.broker.watch.engine_metrics import EngineScrapes, parse, ttft_p90, whole_lines
from xhpc.models import EngineKind, ReplicaState
from xhpc.records import ReplicaRecord


def exposition(running: float, waiting: float, kv: float, ttft: dict[str, float]) -> str:
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",model_name="/m, x"}} {running}',
        f'vllm:num_requests_waiting{{engine="0",model_name="/m, x"}} {waiting}',
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="/m, x"}} {kv}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for le, n in ttft.items():
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",'
                     f'model_name="/m"}} {n}')  # fmt: skip
    total = max(ttft.values(), default=0)
    lines += [
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="/m"}} {total}',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="/m"}} {total / 10}',
        'python_gc_objects_collected_total{generation="0"} 1.0',
        "garbage line",
    ]
    return "\n".join(lines) + "\n"


def test_the_gauges_and_the_ttft_p90_between_two_scrapes() -> None:
    first = parse(exposition(3, 2, 0.42, {"0.1": 5, "0.5": 10, "1.0": 10, "+Inf": 10}))
    assert (first.running, first.waiting, first.kv_use) == (3.0, 2.0, 0.42)
    # 10 more requests since: 1 under 0.1 s, 8 more under 0.5 s, 1 more under 1 s
    second = parse(exposition(1, 0, 0.9, {"0.1": 6, "0.5": 19, "1.0": 20, "+Inf": 20}))
    assert ttft_p90(first, second) == 0.5
    assert ttft_p90(second, second) is None  # no request between
    slow = parse(exposition(0, 0, 0.1, {"0.1": 0, "0.5": 0, "1.0": 0, "+Inf": 4}))
    assert ttft_p90(None, slow) == 1.0  # over the last finite bound: that bound
    assert parse("").kv_use is None and parse('x{le="a"} b\n#\n').running == 0


async def test_ready_vllm_engines_are_scraped_with_their_secret(tmp_path: Path) -> None:
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(text=exposition(2, 1, 0.5, {"0.1": 1, "+Inf": 1}))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    scrapes = EngineScrapes()
    async with serve(app) as url:
        ready = _row("m-0", "m", url, "s3cret", ReplicaState.READY)
        starting = _row("m-1", "m", url, "s", ReplicaState.STARTING)
        other = _row("m-2", "m", url, "s", ReplicaState.READY).model_copy(
            update={"engine": EngineKind.TRANSFORMERS}
        )
        dead = _row("m-3", "m", "http://127.0.0.1:9", "s", ReplicaState.READY)
        try:
            await scrapes.scrape([r for r in (ready, starting, other, dead)
                                  if r.state is ReplicaState.READY
                                  and r.engine is EngineKind.VLLM])  # fmt: skip
            assert seen == ["Bearer s3cret"]
            assert scrapes.of(["m-0", "m-3"]) == (2.0, 1.0, 0.5, 0.1)
            await scrapes.scrape([])  # gone from READY: forgotten
            assert scrapes.of(["m-0"]) == (0.0, 0.0, None, None)
        finally:
            await scrapes.close()


def _placed(row: ReplicaRecord, job: str, node: str) -> ReplicaRecord:
    return row.model_copy(update={"job_id": job, "node": node})


async def _scraped(text: str, *rows: ReplicaRecord) -> EngineScrapes:
    """What a scrape of engines answering ``text`` keeps."""
    scrapes = EngineScrapes()
    try:
        await scrapes.scrape(list(rows))
    finally:
        await scrapes.close()
    return scrapes


async def test_each_engine_s_series_are_written_labelled_where_it_runs() -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=exposition(2, 1, 0.5, {"0.1": 1, "+Inf": 1}))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serve(app) as url:
        a = _placed(_row("m-0", "m", url, "s", ReplicaState.READY), "100", "n1")
        b = _placed(_row("m-1", "m", url, "s", ReplicaState.READY), "101", "n2")
        scrapes = await _scraped("", a, b)
    samples = parse_metrics("\n".join(scrapes.render()) + "\n")
    for rid, job, node in (("m-0", "100", "n1"), ("m-1", "101", "n2")):
        where = {"deployment": "m", "replica": rid, "job": job, "node": node, "engine": "0"}
        assert value(samples, "vllm:num_requests_running", **where, model_name="/m, x") == 2
        bucket = "vllm:time_to_first_token_seconds_bucket"
        assert value(samples, bucket, **where, le="+Inf", model_name="/m") == 1
    assert value(samples, "python_gc_objects_collected_total", deployment="m", replica="m-0",
                 job="100", node="n1", generation="0") == 1  # fmt: skip
    assert [labels for labels, _ in scrapes.ages()] == [
        (("deployment", "m"), ("replica", "m-0")),
        (("deployment", "m"), ("replica", "m-1")),
    ]
    # An engine not heard from for STALE_S is left out (its age still shows).
    stale = max(s.at for s in scrapes.scrapes.values()) + engine_metrics.STALE_S
    assert set(scrapes.fresh(stale)) == set()
    assert scrapes.render(stale) == [] and scrapes.ages(stale)[0][1] >= engine_metrics.STALE_S


@pytest.mark.adversarial
async def test_a_hostile_engine_breaks_neither_the_exposition_nor_the_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostile = (
        "# TYPE vllm:num_requests_running histogram\n"  # a lie: its gauge is dropped
        "vllm:num_requests_running 5\n"
        "vllm:num_requests_waiting +Inf\n"  # no finite number: not in the figures
        "vllm:num_requests_waiting -3\n"
        'vllm:kv_cache_usage_perc{deployment="other",replica="x"} NaN\n'
        'xhpc_broker_replicas{deployment="m",state="READY"} 1000\n'  # the broker's
        "# TYPE xhpc_broker_up gauge\n"
        + "".join(f'spam{{i="{i}"}} {i}\n' for i in range(engine_metrics.MAX_SERIES + 50))
        + "x" * 100_000
        + " 1\n"
    )
    body = hostile.encode()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    monkeypatch.setattr(engine_metrics, "MAX_BYTES", len(body) - 10)  # cut in its last line
    async with serve(app) as url:
        row = _placed(_row("m-0", "m", url, "s", ReplicaState.READY), "100", "n1")
        scrapes = await _scraped("", row)
    scrape = scrapes.scrapes["m-0"]
    assert len(list(scrape.kept.samples())) == engine_metrics.MAX_SERIES
    assert scrape.kept.dropped >= 50
    assert scrapes.of(["m-0"]) == (0.0, 0.0, None, None)  # nothing usable, nothing broken
    text = "\n".join(scrapes.render()) + "\n"
    samples = parse_metrics(text)
    assert not any(name.startswith("xhpc_") for name, _ in samples)
    kv = {"deployment": "m", "replica": "m-0", "job": "100", "node": "n1"}
    assert ("vllm:kv_cache_usage_perc", frozenset({**kv, "exported_deployment": "other",
            "exported_replica": "x"}.items())) in samples  # fmt: skip


def test_an_answer_over_the_limit_is_cut_after_its_last_whole_line() -> None:
    assert whole_lines(b"a 1\nb 22\n", 100) == ("a 1\nb 22\n", False)
    assert whole_lines(b"a 1\nb 22\n", 7) == ("a 1\n", True)  # never "b 2"
    assert whole_lines(b"abcdef", 3) == ("", True)


async def test_the_autoscaler_s_engines_are_asked_every_pass_the_others_every_so_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(engine_metrics, "monotonic", lambda: now[0])
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(text=exposition(1, 0, 0.1, {"+Inf": 1}))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    scrapes = EngineScrapes()
    async with serve(app) as url:
        rows = [_row("a-0", "auto", url, "a", ReplicaState.READY),
                _row("f-0", "fixed", url, "f", ReplicaState.READY)]  # fmt: skip
        try:
            for _ in range(3):  # three passes, a second apart
                scrapes.kick(rows, eager={"auto"})
                task = scrapes._calls.passes.task
                assert task is not None
                await task
                now[0] += 1
            assert sorted(seen) == ["Bearer a"] * 3 + ["Bearer f"]
            now[0] += engine_metrics.EVERY_S
            scrapes.kick(rows, eager={"auto"})
            await scrapes._calls.passes.task  # type: ignore[misc]
            assert seen.count("Bearer f") == 2
            assert set(scrapes.scrapes) == {"a-0", "f-0"}  # asked or not this pass: kept
            scrapes.kick(rows[:1], eager={"auto"})  # f-0 is READY no more: forgotten
            await scrapes._calls.passes.task  # type: ignore[misc]
            assert set(scrapes.scrapes) == {"a-0"}
        finally:
            await scrapes.close()
