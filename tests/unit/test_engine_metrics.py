"""Each engine's own load, from its Prometheus exposition (``xhpc.broker.watch.engine_metrics``):
vLLM's gauges summed over label sets, the fullest KV cache, the p90 time to first token of the
requests between two scrapes (from the histogram's buckets); the scraper asks READY vLLM
engines only, with their secret, and an engine that does not answer is left out."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from tests.proxy_fakes import serve
from tests.unit.test_adapter_desk import _row
from xhpc.broker.watch.engine_metrics import EngineScrapes, parse, ttft_p90
from xhpc.models import EngineKind, ReplicaState


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
