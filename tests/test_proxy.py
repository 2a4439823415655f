"""Component tests for the proxy: real sockets on 127.0.0.1, fake OpenAI-shaped engines."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.proxy_fakes import (
    DEADLINE_S,
    FakeEngine,
    Stack,
    assert_openai_error,
    chat,
    eventually,
    free_port,
    open_stack,
    serve,
    usage_event,
)
from xhpc.config import ProxyConfig, XhpcConfig
from xhpc.models import ProxyLoad, Route, RoutingTable
from xhpc.proxy import BrokerRouteSource, Router, make_app, run_proxy
from xhpc.proxy.engines.upstream_aiohttp import AiohttpUpstream
from xhpc.proxy.engines.upstream_api import Upstream


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for UNIX sockets (their paths are limited to ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="xhpc-", dir="/tmp") as path:
        yield Path(path)


# --- models, health, errors the proxy answers itself ---


async def test_models_lists_every_model_in_the_table(stack: Stack) -> None:
    await stack.engine("a", "m")
    stack.publish("a", models=("cold", "m"))
    async with stack.client.get(stack.url + "/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [e["id"] for e in body["data"]] == ["cold", "m"]
    assert {e["owned_by"] for e in body["data"]} == {"xhpc"}
    assert {e["object"] for e in body["data"]} == {"model"}
    async with stack.client.get(stack.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"


async def test_unknown_model_is_404_model_not_found(stack: Stack) -> None:
    await stack.engine("a", "m")
    stack.publish("a")
    status, _, body = await stack.post("/v1/chat/completions", chat("nope"))
    assert status == 404
    assert_openai_error(body, "model_not_found")
    assert body["error"]["type"] == "invalid_request_error"


async def test_known_model_without_ready_replica_is_503_with_retry_after(stack: Stack) -> None:
    stack.publish(models=("m",))
    status, headers, body = await stack.post("/v1/chat/completions", chat("m"))
    assert status == 503
    assert int(headers["Retry-After"]) > 0
    assert_openai_error(body, "no_ready_replica")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": 3}', "missing_model"),
    ],
)
async def test_malformed_request_is_400(stack: Stack, raw: bytes, code: str) -> None:
    status, _, body = await stack.post("/v1/chat/completions", raw)
    assert status == 400
    assert_openai_error(body, code)


async def test_unknown_path_and_method_are_openai_shaped(stack: Stack) -> None:
    async with stack.client.get(stack.url + "/v2/nothing") as resp:
        assert resp.status == 404
        assert_openai_error(await resp.json(), "not_found")
    async with stack.client.get(stack.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        assert "POST" in resp.headers["Allow"]
        assert_openai_error(await resp.json(), "method_not_allowed")


@pytest.mark.adversarial
async def test_a_path_with_a_newline_is_an_openai_shaped_404(stack: Stack) -> None:
    """Failed before the fix: the catch-all route's ``.`` does not take a newline, so a path
    with ``%0A`` in it got aiohttp's plain-text 404."""
    for path in ("/%0A", "/v2/a%0Ab", "/v1/models%0A/x"):
        async with stack.client.put(stack.url + path) as resp:
            assert resp.status == 404
            assert_openai_error(await resp.json(), "not_found")


# --- forwarding ---


async def test_model_is_rewritten_to_served_model(stack: Stack) -> None:
    engine = await stack.engine("a", "m")
    stack.publish("a")
    status, headers, body = await stack.post("/v1/chat/completions", chat("m", max_tokens=7))
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    assert body["choices"][0]["message"]["content"] == "hello from a"
    assert engine.received == [{**chat("/models/m"), "max_tokens": 7}]
    status, _, body = await stack.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 200
    assert body["choices"][0]["text"] == "text from a"
    assert engine.received[-1] == {"model": "/models/m", "prompt": "x"}


async def test_least_outstanding_sends_to_the_idle_replica(stack: Stack) -> None:
    slow, idle = await stack.engine("a"), await stack.engine("b")
    slow.hold = asyncio.Event()
    stack.publish("a", "b")
    first = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
    await eventually(lambda: len(slow.received) == 1)  # a tie: "a" comes first
    assert stack.router.outstanding("a") == 1
    for _ in range(3):  # while "a" is busy, every request goes to the idle "b"
        status, _, body = await stack.post("/v1/chat/completions", chat())
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello from b"
    assert len(idle.received) == 3 and len(slow.received) == 1
    assert stack.router.outstanding("a") == 1
    slow.hold.set()
    status, _, body = await first
    assert status == 200 and body["choices"][0]["message"]["content"] == "hello from a"
    assert stack.router.outstanding("a") == stack.router.outstanding("b") == 0


async def test_engine_error_passes_through_and_releases_counter(stack: Stack) -> None:
    engine = await stack.engine("a")
    engine.status = 400
    stack.publish("a")
    for body in (chat(), chat(stream=True)):
        status, _, answer = await stack.post("/v1/chat/completions", body)
        assert status == 400
        assert answer == {
            "error": {"message": "bad request at a", "type": "BadRequestError"},
            "object": "error",
        }
        assert stack.router.outstanding("a") == 0


async def test_connect_error_is_502_and_releases_counter(stack: Stack) -> None:
    stack.routes["dead"] = Route(
        model="m", replica_id="dead", url=f"http://127.0.0.1:{free_port()}", served_model="m"
    )
    stack.publish("dead")
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    assert stack.router.outstanding("dead") == 0


async def test_slow_engine_is_504(stack: Stack) -> None:
    await stack.start_proxy(upstream_timeout_s=0.2)
    engine = await stack.engine("a")
    engine.hold = asyncio.Event()
    stack.publish("a")
    status, _, body = await stack.post("/v1/chat/completions", chat())
    engine.hold.set()
    assert status == 504
    assert_openai_error(body, "upstream_timeout")
    assert stack.router.outstanding("a") == 0


# --- streaming ---


async def test_stream_is_byte_exact_and_unbuffered(stack: Stack) -> None:
    engine = await stack.engine("a")
    engine.between_chunks = asyncio.Event()
    stack.publish("a")
    # The engine's events, its model named by the public name, and without the usage chunk
    # the proxy asked for (the client did not).
    expected = FakeEngine.stream_chunks("m")
    got = b""
    data = json.dumps(chat(stream=True)).encode()
    async with stack.client.post(stack.url + "/v1/chat/completions", data=data) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        async with asyncio.timeout(DEADLINE_S):  # the first chunk arrives while the engine waits
            while len(got) < len(expected[0]):
                got += await resp.content.readany()
        assert got == expected[0]
        assert stack.router.outstanding("a") == 1
        engine.between_chunks.set()
        got += await resp.content.read()
    assert got == b"".join(expected)
    chunks = FakeEngine.stream_chunks("/models/m")
    assert engine.sent == b"".join([*chunks[:-1], usage_event("/models/m"), chunks[-1]])
    assert got.endswith(b"data: [DONE]\n\n")
    assert engine.received[0]["model"] == "/models/m"
    assert engine.received[0]["stream_options"] == {"include_usage": True}
    await eventually(lambda: stack.router.outstanding("a") == 0)


async def test_client_leaving_mid_stream_releases_counter(stack: Stack) -> None:
    engine = await stack.engine("a")
    engine.between_chunks = asyncio.Event()
    stack.publish("a")
    data = json.dumps(chat(stream=True)).encode()
    async with stack.client.post(stack.url + "/v1/chat/completions", data=data) as resp:
        assert (await resp.content.readany()).startswith(b"data: ")
        resp.close()
    engine.between_chunks.set()
    await eventually(lambda: stack.router.outstanding("a") == 0)


# --- the official SDK ---


async def test_openai_sdk_chat_plain_and_streamed(stack: Stack) -> None:
    openai = pytest.importorskip("openai")
    engine = await stack.engine("a")
    stack.publish("a")
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    async with client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "hello from a"
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "Hello ✓"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )
    assert [r["model"] for r in engine.received] == ["/models/m", "/models/m"]


# --- routes from the broker ---


class FakeBroker:
    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self.garbage = False
        self.requests = 0
        self.loads: list[ProxyLoad] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/proxy/sync", self.routes)
        return app

    async def routes(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.loads.append(ProxyLoad.model_validate_json(await request.text()))
        if self.garbage:
            return web.Response(text="{not a table", content_type="application/json")
        return web.Response(text=self.table.model_dump_json(), content_type="application/json")


async def test_routes_come_from_the_broker_and_survive_its_death(
    stack: Stack, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await stack.engine("a")
    table = RoutingTable(version=7, models=("m",), routes=(stack.routes["a"],))
    broker = FakeBroker(table)
    path = sock_dir / "broker.sock"
    router = Router()
    app = make_app(router, upstream_timeout_s=DEADLINE_S)
    source = BrokerRouteSource(path, interval_s=0.02)
    source.install(app)
    async with serve(app) as url:
        stack.url = url
        async with serve(broker.app(), unix_path=path):
            await eventually(lambda: router.table.version == 7)
            assert (await stack.post("/v1/chat/completions", chat()))[0] == 200
            broker.garbage = True  # a broker that answers nonsense changes nothing
            await eventually(lambda: source.failures >= 2)
            assert router.table == table
            broker.garbage = False
            await eventually(lambda: source.failures == 0)
            caplog.clear()
        # the broker is gone now
        with caplog.at_level(logging.WARNING, logger="xhpc.proxy.source"):
            await eventually(lambda: source.failures >= 5)
        assert router.table == table
        status, _, body = await stack.post("/v1/chat/completions", chat())
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello from a"
    assert len(engine.received) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per outage, not once per failed poll
    assert broker.requests >= 3


async def test_source_warns_once_per_outage(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = RoutingTable(version=1, models=("m",))
    router = Router()
    source = BrokerRouteSource(sock_dir / "broker.sock", interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="xhpc.proxy.source"):
        async with source:
            assert not await source.poll_once(router)
            assert not await source.poll_once(router)
            async with serve(FakeBroker(table).app(), unix_path=sock_dir / "broker.sock"):
                assert await source.poll_once(router)
            assert router.table == table
            # A replica found unreachable while the broker is away is told once it answers.
            router.unreachable_again("r")
            assert not await source.poll_once(router)
            assert not await source.poll_once(router)
            broker = FakeBroker(table)
            async with serve(broker.app(), unix_path=sock_dir / "broker.sock"):
                assert await source.poll_once(router)
                assert await source.poll_once(router)
            assert [load.unreachable for load in broker.loads] == [("r",), ()]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all("keeping the last known table" in w for w in warnings)
    assert router.table == table


# --- the process entry and the transport seam ---


async def test_run_proxy_writes_ready_file_and_stops_cleanly(sock_dir: Path) -> None:
    engine = FakeEngine("a")
    ready = sock_dir / "proxy.url"
    config = XhpcConfig(
        proxy=ProxyConfig(host="127.0.0.1", port=0, refresh_interval_s=0.02, auth="none")
    )
    async with serve(engine.app()) as engine_url, aiohttp.ClientSession() as client:
        route = Route(model="m", replica_id="a", url=engine_url, served_model="/models/m")
        table = RoutingTable(version=1, models=("m",), routes=(route,))
        async with serve(FakeBroker(table).app(), unix_path=sock_dir / "broker.sock"):
            task = asyncio.create_task(
                run_proxy(config, sock_dir / "broker.sock", ready_file=ready)
            )
            await eventually(ready.exists)
            url = ready.read_text().strip()
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert not ready.exists()
    assert engine.received[0]["model"] == "/models/m"


async def test_injected_upstream_factory_is_used_and_closed(stack: Stack) -> None:
    made: list[aiohttp.ClientSession] = []

    def factory() -> Upstream:
        made.append(aiohttp.ClientSession())
        return AiohttpUpstream(made[-1])

    engine = await stack.engine("a")
    stack.publish("a")
    app = make_app(stack.router, upstream_timeout_s=DEADLINE_S, upstream_factory=factory)
    async with serve(app) as url:
        stack.url = url
        for _ in range(2):
            assert (await stack.post("/v1/chat/completions", chat()))[0] == 200
        assert len(made) == 1 and not made[0].closed
    assert made[0].closed
    assert len(engine.received) == 2


def test_serving_sets_the_collector_and_thread_switches_and_restores_them() -> None:
    import gc
    import sys

    from xhpc.proxy.process.server import GC_GEN0_THRESHOLD, SWITCH_INTERVAL_S, serving_interpreter

    before, switch = gc.get_threshold(), sys.getswitchinterval()
    with serving_interpreter():
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    assert gc.get_threshold() == before
    assert sys.getswitchinterval() == switch
    assert gc.get_freeze_count() == 0
