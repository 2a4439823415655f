"""Component tests: retries before the first byte, broken and unterminated streams, circuit
breakers — a proxy on a real loopback port in front of fake engines that misbehave."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tests.proxy_fakes import (
    FakeEngine,
    Stack,
    assert_openai_error,
    chat,
    chunk_event,
    eventually,
    open_stack,
    sse,
    usage_event,
)
from xhpc.proxy.routes.breaker import BreakerState
from xhpc.settings import ProxyConfig


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


def public(raw: bytes) -> bytes:
    """An engine's bytes as the client gets them: the model named by its public name."""
    return raw.replace(b'"/models/m"', b'"m"')


def parse_events(raw: bytes) -> list[str]:
    """The data of each event, as an OpenAI client reads the stream."""
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events


def assert_error_without_done(raw: bytes, code: str) -> None:
    """The stream ends with a well-formed error event and no [DONE] (it is not whole), and
    every event parses."""
    events = parse_events(raw)
    assert raw.endswith(b"\n\n")
    assert "[DONE]" not in events
    error = json.loads(events[-1])
    assert_openai_error(error, code)
    for event in events[:-1]:
        json.loads(event)


# --- retries before the first byte ---


async def test_refused_connections_are_retried_elsewhere_with_zero_client_errors(
    stack: Stack,
) -> None:
    live = await stack.engine("live")
    stack.dead("dead")
    stack.publish("dead", "live")
    for body in (chat(), chat(stream=True)) * 10:  # sequential: ties put "dead" first often
        if body.get("stream"):
            status, raw = await stack.stream(body)
            assert raw.endswith(b"data: [DONE]\n\n")
        else:
            status, _, _ = await stack.post("/v1/chat/completions", body)
        assert status == 200
    results = await asyncio.gather(*(stack.post("/v1/chat/completions", chat()) for _ in range(30)))
    assert [r[0] for r in results] == [200] * 30
    assert len(live.received) == 50
    text = await stack.metrics()
    assert 'xhpc_proxy_retries_total{model="m",reason="connect_error"}' in text
    assert 'xhpc_proxy_requests_total{model="m",replica="live",status="200"} 50' in text
    assert 'xhpc_proxy_breaker_state{replica="dead"} 1' in text  # ejected after 5 failures
    # The broker hears of it at the next sync (it takes the replica out of every proxy's table),
    # once; a replica that answered is not named.
    assert stack.router.take_unreachable() == ("dead",)
    assert stack.router.take_unreachable() == ()


async def test_requests_an_engine_died_with_are_502s_never_sent_elsewhere(stack: Stack) -> None:
    """Each request had reached the engine when it died: any of them may be what killed it (a
    poison request), so none goes to the other replica; they are answered 502."""
    doomed, live = await stack.engine("a"), await stack.engine("b")
    doomed.hold = asyncio.Event()
    stack.publish("a", "b")
    requests = [asyncio.create_task(stack.post("/v1/chat/completions", chat())) for _ in range(8)]
    streams = [asyncio.create_task(stack.stream(chat(stream=True))) for _ in range(4)]
    await eventually(lambda: len(doomed.received) + len(live.received) == 12)
    held = len(doomed.received)
    assert held >= 1  # least outstanding sent some there before it died
    doomed.kill()  # in-flight connections reset, new ones dropped
    failed = 0
    for status, _, body in await asyncio.gather(*requests):
        if status == 502:
            assert_openai_error(body, "upstream_unreachable")
            failed += 1
        else:
            assert status == 200 and body["choices"][0]["message"]["content"] == "hello from b"
    for status, raw in await asyncio.gather(*streams):
        if status == 502:
            assert_openai_error(json.loads(raw), "upstream_unreachable")
            failed += 1
        else:
            assert status == 200 and raw == b"".join(FakeEngine.stream_chunks("m"))
    assert failed == held
    assert len(live.received) == 12 - held  # none was sent again
    text = await stack.metrics()
    assert "xhpc_proxy_retries_total{" not in text
    assert f'xhpc_proxy_requests_total{{model="m",replica="a",status="502"}} {held}' in text
    assert f'xhpc_proxy_requests_total{{model="m",replica="b",status="200"}} {12 - held}' in text


async def test_upstream_503_is_retried_on_another_replica(stack: Stack) -> None:
    busy, ok = await stack.engine("a"), await stack.engine("b")
    busy.status = 503
    stack.publish("a", "b")
    for _ in range(4):
        status, _, body = await stack.post("/v1/chat/completions", chat())
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello from b"
    assert len(busy.received) >= 1
    assert len(ok.received) == 4


async def test_last_503_is_passed_through_when_every_replica_is_busy(stack: Stack) -> None:
    for rid in ("a", "b", "c", "d"):
        (await stack.engine(rid)).status = 503
    stack.publish("a", "b", "c", "d")
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 503
    assert body["error"]["message"].startswith("bad request at")  # the engine's own body
    tried = [rid for rid, e in stack.engines.items() if e.received]
    assert len(tried) == 3  # one attempt and max_retries=2 retries, each on another replica


async def test_retry_budget_caps_retries(stack: Stack) -> None:
    config = ProxyConfig(retry_budget_burst=2, retry_budget_ratio=0.0, breaker_failures=1000)
    await stack.start_proxy(config=config)
    for rid in ("a", "b"):
        (await stack.engine(rid)).status = 503
    stack.publish("a", "b")
    for _ in range(5):
        status, _, _ = await stack.post("/v1/chat/completions", chat())
        assert status == 503
    attempts = sum(len(e.received) for e in stack.engines.values())
    assert attempts == 5 + 2  # two retries in the budget, none after
    assert 'xhpc_proxy_retries_denied_total{model="m"} 3' in await stack.metrics()


async def test_a_stream_that_dies_before_its_first_event_is_a_502_not_retried(
    stack: Stack,
) -> None:
    broken, ok = await stack.engine("a"), await stack.engine("b")
    broken.break_after = 0  # headers, then the connection drops
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])  # "a" is idle: the request goes there
    status, raw = await stack.stream(chat(stream=True))
    assert status == 502
    assert_openai_error(json.loads(raw), "upstream_unreachable")
    assert len(broken.received) == 1 and ok.received == []


async def test_a_partial_first_event_is_not_sent_and_the_stream_is_a_502(stack: Stack) -> None:
    broken, ok = await stack.engine("a"), await stack.engine("b")
    whole = sse(chunk_event("/models/m", "x"))
    broken.script = [whole[:20], whole[20:]]
    broken.break_after = 1  # the first half of an event, then the connection drops
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])
    status, raw = await stack.stream(chat(stream=True))
    assert status == 502
    assert_openai_error(json.loads(raw), "upstream_unreachable")  # no piece of the event
    assert len(broken.received) == 1 and ok.received == []


# --- no retry after the first byte ---


async def test_stream_broken_after_first_byte_ends_with_an_error_event(stack: Stack) -> None:
    broken, other = await stack.engine("a"), await stack.engine("b")
    broken.break_after = 2
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])  # "a" is idle: the request goes there
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200
    chunks = FakeEngine.stream_chunks("m")
    assert raw.startswith(chunks[0] + chunks[1])
    assert_error_without_done(raw, "upstream_stream_broken")
    assert len(broken.received) == 1 and other.received == []  # never retried
    text = await stack.metrics()
    assert 'xhpc_proxy_stream_errors_total{kind="broken"' not in text  # labels are ordered
    assert 'xhpc_proxy_stream_errors_total{model="m",replica="a",kind="broken"} 1' in text
    await eventually(lambda: stack.router.outstanding("a") == 0)


async def test_stream_broken_mid_event_still_parses_for_the_client(stack: Stack) -> None:
    engine = await stack.engine("a")
    first = sse(chunk_event("/models/m", "x"))
    second = sse(chunk_event("/models/m", "y"))
    engine.script = [first, second[:15], second[15:]]
    engine.break_after = 2
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200
    assert raw.startswith(public(first))
    assert raw[len(public(first)) :].startswith(b'data: {"error": ')  # the half never left
    assert_error_without_done(raw, "upstream_stream_broken")


async def test_stream_without_done_is_terminated(stack: Stack) -> None:
    engine = await stack.engine("a")
    chunks = [*FakeEngine.stream_chunks("/models/m")[:-1], usage_event("/models/m")]
    engine.script = chunks
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True, stream_options={"include_usage": True}))
    assert status == 200
    assert raw == public(b"".join(chunks)) + b"data: [DONE]\n\n"
    text = await stack.metrics()
    assert 'xhpc_proxy_stream_errors_total{model="m",replica="a",kind="unterminated"} 1' in text
    assert 'xhpc_proxy_tokens_total{model="m",kind="completion"} 2' in text


async def test_openai_sdk_reads_a_stream_without_done(stack: Stack) -> None:
    openai = pytest.importorskip("openai")
    engine = await stack.engine("a")
    engine.script = FakeEngine.stream_chunks("/models/m")[:-1]
    stack.publish("a")
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async with asyncio.timeout(5):
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "Hello ✓"


async def test_stream_with_usage_is_byte_exact_and_counted(stack: Stack) -> None:
    engine = await stack.engine("a")
    model = "/models/m"
    chunks = [*FakeEngine.stream_chunks(model)[:-1], usage_event(model), b"data: [DONE]\n\n"]
    engine.script = chunks
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True, stream_options={"include_usage": True}))
    assert status == 200
    assert raw == public(engine.sent) == public(b"".join(chunks))
    text = await stack.metrics()
    assert 'xhpc_proxy_tokens_total{model="m",kind="prompt"} 3' in text
    assert 'xhpc_proxy_tokens_total{model="m",kind="completion"} 2' in text
    assert 'xhpc_proxy_ttft_seconds_count{model="m"} 1' in text
    assert "xhpc_proxy_stream_errors_total{" not in text


# --- circuit breakers ---


async def test_breaker_ejects_a_failing_replica_probes_it_and_closes(stack: Stack) -> None:
    config = ProxyConfig(breaker_failures=3, breaker_cooldown_s=10, max_retries=0)
    now = [0.0]
    await stack.start_proxy(config=config, clock=lambda: now[0])
    bad, good = await stack.engine("a"), await stack.engine("b")
    bad.status = 500
    stack.publish("a", "b")
    statuses = []
    for _ in range(12):  # round-robin-like ties: "a" fails three times, then is skipped
        statuses.append((await stack.post("/v1/chat/completions", chat()))[0])
    assert statuses.count(500) == 3
    assert len(bad.received) == 3 and len(good.received) == 9
    assert stack.router.breakers.state("a") is BreakerState.OPEN
    text = await stack.metrics()
    assert 'xhpc_proxy_breaker_state{replica="a"} 1' in text
    assert 'xhpc_proxy_breaker_state{replica="b"} 0' in text
    assert 'xhpc_proxy_breaker_ejections_total{replica="a"} 1' in text
    # after the cool-down one probe goes through; it fails: open again
    now[0] += 10
    stack.router.acquire(stack.routes["b"])
    assert (await stack.post("/v1/chat/completions", chat()))[0] == 500
    assert len(bad.received) == 4
    assert stack.router.breakers.state("a") is BreakerState.OPEN
    # the replica recovers: the next probe closes the breaker and it takes traffic again
    bad.status = 200
    now[0] += 10
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 200 and body["choices"][0]["message"]["content"] == "hello from a"
    assert stack.router.breakers.state("a") is BreakerState.CLOSED
    stack.router.release(stack.routes["b"])


async def test_every_replica_ejected_is_503_with_retry_after(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(breaker_failures=1, breaker_cooldown_s=30))
    stack.dead("dead")
    stack.publish("dead")
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    status, headers, body = await stack.post("/v1/chat/completions", chat())
    assert status == 503
    assert 25 <= int(headers["Retry-After"]) <= 30
    assert_openai_error(body, "no_ready_replica")
    assert "ejected" in body["error"]["message"]


async def test_client_errors_do_not_trip_the_breaker(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(breaker_failures=1))
    engine = await stack.engine("a")
    engine.status = 400
    stack.publish("a")
    for _ in range(3):
        assert (await stack.post("/v1/chat/completions", chat()))[0] == 400
    assert stack.router.breakers.state("a") is BreakerState.CLOSED
