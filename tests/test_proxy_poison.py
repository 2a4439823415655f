"""One poison request never takes down a deployment, and one caller never ejects a replica:
a request is retried on another replica only if it never reached an engine, and the circuit
breakers count the engines' faults, not a client leaving or a long answer running out of time."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.pd_fakes import open_pd_stack
from tests.proxy_fakes import (
    DEADLINE_S,
    ScriptedEngine,
    Stack,
    assert_openai_error,
    chat,
    eventually,
    free_port,
    open_stack,
    scripted_engine,
)
from xhpc.agent.liveness import LivenessPort
from xhpc.models import PdRole, Route
from xhpc.proxy import bound_url, make_app
from xhpc.proxy.routes.breaker import BreakerState
from xhpc.settings import ProxyConfig

pytestmark = pytest.mark.security


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_request_that_kills_its_engine_is_not_sent_to_the_next_one(
    stack: Stack, streamed: bool
) -> None:
    """Both engines die of this request (an engine OOM on a 20 MB body); the first one's
    death must not be followed by the second one's."""
    for rid in ("a", "b"):
        (await stack.engine(rid)).dead = True  # reads the request, then resets the connection
    stack.publish("a", "b")
    big = "x" * (512 << 10)  # the fake engines take up to 1 MB
    body = chat(messages=[{"role": "user", "content": big}], stream=streamed)
    data = json.dumps(body).encode()
    async with asyncio.timeout(DEADLINE_S):
        async with stack.client.post(stack.url + "/v1/chat/completions", data=data) as resp:
            status, answer = resp.status, await resp.json()
    assert status == 502
    assert_openai_error(answer, "upstream_unreachable")
    assert sorted(len(e.received) for e in stack.engines.values()) == [0, 1]
    assert "xhpc_proxy_retries_total{" not in await stack.metrics()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_request_whose_whole_job_is_gone_goes_to_another_replica(
    stack: Stack, streamed: bool
) -> None:
    """The engine reset the connection and its agent does not answer either (a lost node):
    the request cannot have caused that, so it is sent to the next replica and succeeds. With
    the agent alive it is the poison case above: one engine tried, a 502."""
    lost = await stack.engine("a")
    lost.dead = True
    await stack.engine("b")
    gone_agent = free_port()  # nothing listens: the job is gone
    stack.routes["a"] = stack.routes["a"].model_copy(update={"agent_port": gone_agent})
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])  # "a" first
    if streamed:
        status, raw = await stack.stream(chat(stream=True))
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    else:
        status, _, body = await stack.post("/v1/chat/completions", chat())
        assert status == 200, body
    assert len(stack.engines["a"].received) == 1 and len(stack.engines["b"].received) == 1
    assert 'reason="job_gone"' in await stack.metrics()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_request_to_a_job_that_fell_silent_goes_to_another_replica(
    streamed: bool,
) -> None:
    """A node whose link went down: the engine neither answers nor breaks the connection. After
    ``job_check_after_s`` with no byte, the agent is asked; it does not answer either, so the
    request goes to the next replica. With the agent alive, the request keeps waiting."""
    config = ProxyConfig(job_check_after_s=0.2)
    async with open_stack(config) as stack:
        silent = await stack.engine("a")
        silent.hold = asyncio.Event()  # never answers on its own
        await stack.engine("b")
        stack.routes["a"] = stack.routes["a"].model_copy(update={"agent_port": free_port()})
        stack.publish("a", "b")
        stack.router.acquire(stack.routes["b"])  # "a" first
        async with asyncio.timeout(DEADLINE_S):
            if streamed:
                status, raw = await stack.stream(chat(stream=True))
                assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            else:
                status, _, body = await stack.post("/v1/chat/completions", chat())
                assert status == 200, body
        assert len(silent.received) == 1 and len(stack.engines["b"].received) == 1
        assert 'reason="job_gone"' in await stack.metrics()

        agent = LivenessPort()  # now the agent answers: a slow engine, not a lost job
        port = await agent.start("127.0.0.1")
        try:
            stack.routes["a"] = stack.routes["a"].model_copy(update={"agent_port": port})
            stack.publish("a", "b")
            stack.router.acquire(stack.routes["b"])
            stack.router.acquire(stack.routes["b"])  # "a" first, again
            waiting = asyncio.ensure_future(stack.post("/v1/chat/completions", chat()))
            await asyncio.sleep(1.0)  # five checks' worth: the agent answers every one
            assert not waiting.done() and len(stack.engines["b"].received) == 1
            silent.hold.set()
            status, _, body = await asyncio.wait_for(waiting, DEADLINE_S)
            assert status == 200, body
        finally:
            await agent.stop()


async def test_a_stream_under_way_whose_job_fell_silent_ends_with_an_error_event() -> None:
    async with open_stack(ProxyConfig(job_check_after_s=0.2)) as stack:
        silent = await stack.engine("a")
        silent.between_chunks = asyncio.Event()  # the first event, then silence
        stack.routes["a"] = stack.routes["a"].model_copy(update={"agent_port": free_port()})
        stack.publish("a")
        try:
            status, raw = await stack.stream(chat(stream=True))
        finally:
            silent.between_chunks.set()
    assert status == 200
    assert raw.startswith(b"data: ") and b"its job is gone" in raw, raw[-300:]
    assert b"upstream_stream_broken" in raw and b"[DONE]" not in raw


async def test_a_dead_engine_whose_agent_answers_is_not_retried(stack: Stack) -> None:
    agent = LivenessPort()
    port = await agent.start("127.0.0.1")
    try:
        (await stack.engine("a")).dead = True
        await stack.engine("b")
        stack.routes["a"] = stack.routes["a"].model_copy(update={"agent_port": port})
        stack.publish("a", "b")
        stack.router.acquire(stack.routes["b"])  # "a" first
        status, _, body = await stack.post("/v1/chat/completions", chat())
    finally:
        await agent.stop()
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    assert stack.engines["b"].received == []


async def test_a_refused_connection_is_still_retried(stack: Stack) -> None:
    await stack.engine("b")
    stack.dead("a")
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])  # "a" first
    status, _, _ = await stack.post("/v1/chat/completions", chat())
    assert status == 200
    assert len(stack.engines["b"].received) == 1


async def test_a_prefill_leg_that_kills_its_instance_is_not_sent_to_another() -> None:
    async with open_pd_stack() as pd, scripted_engine(lambda _: [b"<close>"]) as poisoned:
        healthy = await pd.prefill("p2")
        await pd.decode("d1")
        pd.stack.routes["p1"] = Route(
            model="pd",
            replica_id="p1",
            url=poisoned.base,
            served_model="/models/pd",
            role=PdRole.PREFILL,
            unit="unit-p1",
        )
        pd.publish("p1", "p2", "d1")
        pd.stack.router.acquire(pd.stack.routes["p2"])  # "p1" first
        status, _, body = await pd.post(chat("pd"))
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    assert len(poisoned.requests) == 1 and healthy.received == []


# --- breakers count the engines' faults only ---


async def test_clients_leaving_mid_stream_do_not_eject_the_replica(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(breaker_failures=1))
    engine = await stack.engine("a")
    stack.publish("a")
    for _ in range(3):
        engine.between_chunks = asyncio.Event()
        data = json.dumps(chat(stream=True)).encode()
        async with stack.client.post(stack.url + "/v1/chat/completions", data=data) as resp:
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()
        engine.between_chunks.set()
        await eventually(lambda: stack.router.outstanding("a") == 0)
    assert stack.router.breakers.state("a") is BreakerState.CLOSED
    assert (await stack.post("/v1/chat/completions", chat()))[0] == 200


async def test_a_long_answer_that_runs_out_of_time_does_not_eject_the_replica(
    stack: Stack,
) -> None:
    """A client asked for a huge max_tokens without streaming: its 504 is its own doing."""
    await stack.start_proxy(upstream_timeout_s=0.3, config=ProxyConfig(breaker_failures=1))
    engine = await stack.engine("a")
    stack.publish("a")
    engine.hold = asyncio.Event()
    status, _, body = await stack.post("/v1/chat/completions", chat(max_tokens=1_000_000))
    assert status == 504
    assert_openai_error(body, "upstream_timeout")
    assert stack.router.breakers.state("a") is BreakerState.CLOSED
    engine.hold.set()
    assert (await stack.post("/v1/chat/completions", chat()))[0] == 200


async def test_a_stream_that_stalls_still_counts_against_its_engine(stack: Stack) -> None:
    await stack.start_proxy(upstream_timeout_s=0.3, config=ProxyConfig(breaker_failures=1))
    engine = await stack.engine("a")
    stack.publish("a")
    engine.between_chunks = asyncio.Event()  # the first event, then nothing
    status, raw = await stack.stream(chat(stream=True))
    engine.between_chunks.set()
    assert status == 200 and b"upstream_stream_broken" in raw
    assert stack.router.breakers.state("a") is BreakerState.OPEN


async def test_a_probe_whose_client_left_lets_the_next_request_probe(stack: Stack) -> None:
    """A server that cancels the handlers of clients that leave: the breaker's one probe slot
    is given back, not held forever by a request that ended without a verdict."""
    config = ProxyConfig(breaker_failures=1, breaker_cooldown_s=10, max_retries=0)
    now = [0.0]
    await stack.start_proxy(config=config, clock=lambda: now[0])
    runner = web.AppRunner(make_app(stack.router, keys=None), handler_cancellation=True)
    await runner.setup()
    stack.exits.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = bound_url(runner)
    engine = await stack.engine("a")
    stack.publish("a")
    engine.status = 500
    async with stack.client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 500
    assert stack.router.breakers.state("a") is BreakerState.OPEN
    now[0] += 10  # the cool-down is over: the next request is the probe
    engine.status, engine.hold = 200, asyncio.Event()
    probe = asyncio.create_task(stack.client.post(url + "/v1/chat/completions", json=chat()))
    await eventually(lambda: len(engine.received) == 2)
    probe.cancel()  # the client leaves; its handler is cancelled
    with contextlib.suppress(asyncio.CancelledError):
        await probe
    await eventually(lambda: stack.router.outstanding("a") == 0)
    assert stack.router.breakers.state("a") is not BreakerState.HALF_OPEN
    engine.hold.set()
    async with stack.client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
    assert stack.router.breakers.state("a") is BreakerState.CLOSED


OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def test_an_engine_that_dies_on_a_reused_connection_is_not_followed_by_the_next(
    stack: Stack,
) -> None:
    """The usual case under load: the poison request goes out on a pooled keep-alive
    connection, and the engine process dies of it (its connections close, its port refuses)."""
    server: list[asyncio.Server] = []

    def answer(request: bytes) -> list[bytes]:
        if b"poison" not in request:
            return [OK_ANSWER]
        server[0].close()  # the process is gone: its port refuses from now on
        return [b"<close>"]

    dying = type("Dying", (ScriptedEngine,), {"answer": staticmethod(answer)})
    dying.requests, dying.connections = [], []
    server.append(await asyncio.get_running_loop().create_server(dying, "127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{server[0].sockets[0].getsockname()[1]}"
        other = await stack.engine("b")
        stack.routes["a"] = Route(model="m", replica_id="a", url=url, served_model="m")
        stack.publish("a", "b")
        stack.router.acquire(stack.routes["b"])  # "a" first, both times
        assert (await stack.post("/v1/chat/completions", chat()))[0] == 200  # pooled now
        status, _, body = await stack.post("/v1/chat/completions", chat("m", poison=True))
    finally:
        server[0].close()
        for conn in dying.connections:
            conn.transport.close()
    assert len(dying.requests) == 2
    assert status == 502, body
    assert other.received == []
