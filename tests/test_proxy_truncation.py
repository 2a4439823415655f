"""No truncated 200s: an engine that dies mid-answer never reaches the client as a whole answer.

A body cut before its Content-Length or its last chunk is a 502 (OpenAI-shaped), or the answer of
another replica; a stream cut after its first events ends with an error event and no [DONE].
Both transports the proxy can run (its own upstream client and aiohttp's) are checked, through
the real proxy on loopback in front of engines scripted byte by byte.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from tests.proxy_fakes import (
    DEADLINE_S,
    ScriptedEngine,
    Stack,
    assert_openai_error,
    chat,
    open_stack,
    scripted_engine,
    serve,
)
from xhpc.models import Route
from xhpc.proxy import aiohttp_upstream, make_app

BODY = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": []}).encode()
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i for i in range(3)]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CUT_BODIES = {
    "content-length": [WHOLE[: len(WHOLE) - 10], b"<close>"],
    "chunked": [CHUNKED_HEAD + chunk(BODY[:20]), b"<close>"],
    "chunked, no last chunk": [CHUNKED_HEAD + chunk(BODY), b"<close>"],
}


@pytest.fixture(params=["upstream", "aiohttp"])
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """A proxy on its own upstream client (the default), or on aiohttp's (the seam)."""
    async with open_stack() as s:
        if request.param == "aiohttp":
            app = make_app(
                s.router,
                upstream_timeout_s=DEADLINE_S,
                upstream_factory=aiohttp_upstream,
            )
            s.url = await s.exits.enter_async_context(serve(app))
        yield s


async def scripted(s: Stack, replica_id: str, answer: list[bytes]) -> type[ScriptedEngine]:
    engine = await s.exits.enter_async_context(scripted_engine(lambda _: answer))
    s.routes[replica_id] = Route(
        model="m", replica_id=replica_id, url=engine.base, served_model="/models/m"
    )
    return engine


@pytest.mark.parametrize("cut", sorted(CUT_BODIES))
async def test_a_body_cut_short_is_a_502_never_a_truncated_200(stack: Stack, cut: str) -> None:
    engine = await scripted(stack, "a", CUT_BODIES[cut])
    stack.publish("a")
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    assert len(engine.requests) == 1


@pytest.mark.parametrize("cut", sorted(CUT_BODIES))
async def test_a_body_cut_short_is_not_sent_to_another_replica(stack: Stack, cut: str) -> None:
    """The engine had the request (it began to answer): it may be what broke it."""
    await scripted(stack, "a", CUT_BODIES[cut])
    other = await scripted(stack, "b", [WHOLE])
    stack.publish("a", "b")
    stack.router.acquire(stack.routes["b"])  # "a" is idle: the first try goes there
    status, _, body = await stack.post("/v1/chat/completions", chat())
    stack.router.release(stack.routes["b"])
    assert status == 502
    assert_openai_error(body, "upstream_unreachable")
    assert other.requests == []


async def test_a_stream_cut_mid_way_ends_with_an_error_event_and_no_done(stack: Stack) -> None:
    await scripted(stack, "a", [SSE_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[1]), b"<close>"])
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200
    assert raw.startswith(EVENTS[0] + EVENTS[1])
    rest = raw[len(EVENTS[0] + EVENTS[1]) :]
    assert rest.startswith(b"data: ") and rest.endswith(b"\n\n") and rest.count(b"\n\n") == 1
    assert_openai_error(json.loads(rest[6:]), "upstream_stream_broken")
    assert b"[DONE]" not in raw


async def test_a_whole_stream_still_ends_with_done(stack: Stack) -> None:
    whole = SSE_HEAD + b"".join(map(chunk, EVENTS)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    await scripted(stack, "a", [whole])
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200
    assert raw == b"".join(EVENTS) + b"data: [DONE]\n\n"
