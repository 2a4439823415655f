"""The proxy's own HTTP/1.1 client (xhpc.proxy.engines.upstream) against engines that misbehave:
large answers read to their end or refused over the limit (never a hang), framing the client refuses
at once, connections never reused after a protocol error, idle connections dropped before the
engine drops them, and the one safe resend of a request on a reused connection the engine had
closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from tests.proxy_fakes import (
    DEADLINE_S,
    assert_openai_error,
    chat,
    open_stack,
    scripted_engine,
    serve,
)
from xhpc.models import Route
from xhpc.proxy import make_app
from xhpc.proxy.engines.upstream import UpstreamSession
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    UpstreamAnswerTooLarge,
    UpstreamDropped,
    UpstreamProtocolError,
)

pytestmark = pytest.mark.security

TIMEOUT = Timeouts(total=10, connect=5)
STREAM_TIMEOUT = Timeouts(connect=5, read=10)
HEADERS = {"Content-Type": "application/json"}
OK_BODY = b'{"id": "x"}'
OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY)
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
# an embeddings answer of 2.3 MB, as one engine sends for a batch of inputs
EMBEDDINGS = json.dumps(
    {
        "object": "list",
        "data": [{"embedding": [0.123456789] * 1000, "index": i} for i in range(180)],
    }
).encode()


def whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def chunked(body: bytes, size: int = 65536) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return CHUNKED_HEAD + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def in_turn(*answers: list[bytes]) -> Callable[[bytes], list[bytes]]:
    """An engine's script: the n-th request it gets is answered with ``answers[n]``."""
    count = iter(range(len(answers)))
    return lambda _: answers[next(count)]


async def post(session: UpstreamSession, url: str, *, stream: bool = False) -> bytes:
    timeout = STREAM_TIMEOUT if stream else TIMEOUT
    async with session.post(url, data=b"{}", headers=HEADERS, timeout=timeout) as r:
        if stream:
            return b"".join([chunk async for chunk in r.chunks()])
        return await r.read()


@pytest.mark.parametrize("framing", [whole, chunked])
async def test_a_large_answer_read_whole_is_read_to_its_end(
    framing: Callable[[bytes], bytes],
) -> None:
    assert len(EMBEDDINGS) > 2_000_000
    async with scripted_engine(lambda _: [framing(EMBEDDINGS)]) as e:
        session = UpstreamSession()
        for _ in range(2):  # a read that stalled (a paused reader never resumed) would hang
            assert await asyncio.wait_for(post(session, e.url), timeout=30) == EMBEDDINGS
        await session.close()
    assert len(e.connections) == 1  # read whole, so reused


async def test_a_large_answer_read_whole_late_is_read_to_its_end() -> None:
    """Its first MiB came before ``read``: reading paused, as for a stream, and resumed."""
    async with scripted_engine(lambda _: [chunked(EMBEDDINGS)]) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            await asyncio.sleep(0.2)
            assert r._paused  # the path that once never resumed
            assert await r.read() == EMBEDDINGS
        await session.close()


async def test_a_large_stream_is_relayed_whole_while_its_reader_keeps_up() -> None:
    async with scripted_engine(lambda _: [chunked(EMBEDDINGS, 4096)]) as e:
        session = UpstreamSession()
        assert await post(session, e.url, stream=True) == EMBEDDINGS
        await session.close()


@pytest.mark.parametrize("framing", [whole, chunked])
async def test_an_answer_over_the_limit_is_refused_at_once(
    framing: Callable[[bytes], bytes],
) -> None:
    async with scripted_engine(in_turn([framing(EMBEDDINGS)], [OK])) as e:
        session = UpstreamSession(max_body_bytes=1_500_000)
        with pytest.raises(UpstreamAnswerTooLarge) as info:  # not read on to the end
            await asyncio.wait_for(post(session, e.url), timeout=20)
        assert isinstance(info.value, UpstreamProtocolError)
        assert "1500000 bytes" in str(info.value)
        assert await post(session, e.url) == OK_BODY
        await session.close()
    assert len(e.connections) == 2  # the refused answer's connection was closed


async def test_an_answer_over_the_limit_is_a_clear_openai_shaped_502() -> None:
    async with open_stack() as s, scripted_engine(lambda _: [whole(EMBEDDINGS)]) as e:
        app = make_app(
            s.router,
            upstream_timeout_s=DEADLINE_S,
            upstream_factory=lambda: UpstreamSession(max_body_bytes=1_000_000),
        )
        s.url = await s.exits.enter_async_context(serve(app))
        s.routes["a"] = Route(model="m", replica_id="a", url=e.base, served_model="/models/m")
        s.publish("a")
        status, _, body = await s.post("/v1/embeddings", {"model": "m", "input": "hi"})
    assert status == 502
    assert_openai_error(body, "upstream_answer_too_large")
    assert "1000000 bytes" in body["error"]["message"]


async def test_a_malformed_answer_is_a_clear_openai_shaped_502() -> None:
    bad = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\n"]
    async with open_stack() as s, scripted_engine(lambda _: bad) as e:
        s.routes["a"] = Route(model="m", replica_id="a", url=e.base, served_model="/models/m")
        s.publish("a")
        status, _, body = await s.post("/v1/chat/completions", chat())
    assert status == 502
    assert_openai_error(body, "upstream_bad_answer")
    assert "chunk size" in body["error"]["message"]


@pytest.mark.parametrize(
    "answer",
    [
        CHUNKED_HEAD + b"-6\r\n",  # a 49-byte answer that once froze the event loop
        CHUNKED_HEAD + b"0x5\r\nhello\r\n0\r\n\r\n",
        CHUNKED_HEAD + b"+5\r\nhello\r\n0\r\n\r\n",
        CHUNKED_HEAD + b"0_5\r\nhello\r\n0\r\n\r\n",
        CHUNKED_HEAD + b" 5\r\nhello\r\n0\r\n\r\n",
        CHUNKED_HEAD + b"5" * 20_000,  # a chunk-size line without end
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nokabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: notchunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        CHUNKED_HEAD[:-2] + b"Content-Length: 9\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 9000 + b"\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000,  # a head without end
        b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 101 + b"Content-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n folded: 1\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nX-A : 1\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" * 9,
        b"HTTP/2 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 20 OK\r\nContent-Length: 2\r\n\r\nok",
        CHUNKED_HEAD + b"2\r\nokXX",  # a chunk not ended by CRLF
        CHUNKED_HEAD + b"2\r\nok\r\n0\r\nbad trailer\r\n\r\n",
    ],
)
async def test_a_malformed_answer_is_refused_at_once_and_its_connection_closed(
    answer: bytes,
) -> None:
    """The engine keeps the connection open: the client must not wait for more bytes."""
    async with scripted_engine(in_turn([answer], [OK])) as e:
        session = UpstreamSession()
        # A client that waited for more bytes would hang here (the engine never closes): the
        # deadline tells the two apart without timing how fast the refusal is.
        with pytest.raises(UpstreamProtocolError):
            await asyncio.wait_for(post(session, e.url), timeout=20)
        assert await post(session, e.url) == OK_BODY
        await session.close()
    assert len(e.connections) == 2


@pytest.mark.parametrize(
    "answer",
    [
        CHUNKED_HEAD + b"0005;name=value\r\nhello\r\n0\r\n\r\n",
        CHUNKED_HEAD + b"5 ; ext\r\nhello\r\n0;x\r\nX-Trailer: 1\r\n\r\n",
        CHUNKED_HEAD.replace(b"chunked", b"Chunked") + b"5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length:   5  \r\nX-Empty:\r\n\r\nhello",
        b"HTTP/1.1 200\r\nContent-Length: 5\r\n\r\nhello",
    ],
)
async def test_answers_inside_the_grammar_are_read_and_the_connection_reused(
    answer: bytes,
) -> None:
    async with scripted_engine(lambda _: [answer]) as e:
        session = UpstreamSession()
        for _ in range(2):
            assert await post(session, e.url) == b"hello"
        await session.close()
    assert len(e.connections) == 1


async def test_a_reused_connection_closed_before_any_answer_is_retried_once() -> None:
    """The engine's keep-alive ran out as the request went out: it never saw it."""
    async with scripted_engine(in_turn([OK], [b"<close>"], [OK])) as e:
        session = UpstreamSession()
        assert await post(session, e.url) == OK_BODY
        assert await post(session, e.url) == OK_BODY  # transparently, on a new connection
        await session.close()
    assert len(e.connections) == 2
    assert len(e.requests) == 3


async def test_a_reused_connection_reset_before_any_answer_is_retried_once() -> None:
    async with scripted_engine(in_turn([OK], [OK])) as e:
        session = UpstreamSession()
        assert await post(session, e.url) == OK_BODY
        await asyncio.sleep(0.05)
        e.connections[0].transport.abort()  # an RST as the next request goes out
        assert await post(session, e.url) == OK_BODY
        await session.close()
    assert len(e.connections) == 2


@pytest.mark.parametrize("second", [[OK[:10], b"<close>"], [b"<close>"]])
async def test_the_resend_is_once_and_only_before_any_byte_of_an_answer(
    second: list[bytes],
) -> None:
    """Bytes of an answer came (the engine began on it), or the connection was new, or the
    resend failed too: the failure is the caller's, never sent a third time."""
    async with scripted_engine(in_turn([OK], second, [b"<close>"], [OK])) as e:
        session = UpstreamSession()
        assert await post(session, e.url) == OK_BODY
        with pytest.raises(UpstreamDropped):
            await post(session, e.url)
        await session.close()
    assert len(e.requests) == (2 if len(second) == 2 else 3)


async def test_a_new_connection_closed_before_any_answer_is_not_retried() -> None:
    async with scripted_engine(in_turn([b"<close>"], [OK])) as e:
        session = UpstreamSession()
        with pytest.raises(UpstreamDropped):
            await post(session, e.url)
        await session.close()
    assert len(e.requests) == 1


async def test_idle_connections_are_dropped_before_the_engines_drop_them() -> None:
    assert UpstreamSession().idle_s < 5.0  # uvicorn's keep-alive
    async with scripted_engine(lambda _: [OK]) as e:
        session = UpstreamSession(idle_s=0.1)
        await post(session, e.url)
        await post(session, e.url)
        assert len(e.connections) == 1
        await asyncio.sleep(0.2)
        await post(session, e.url)
        await session.close()
    assert len(e.connections) == 2
    assert e.connections[0].transport.is_closing()


async def test_bytes_after_a_whole_answer_keep_its_connection_from_the_pool() -> None:
    async with scripted_engine(in_turn([OK + b"HTTP/1.1 200 OK\r\n"], [OK])) as e:
        session = UpstreamSession()
        assert await post(session, e.url) == OK_BODY
        assert await post(session, e.url) == OK_BODY
        await session.close()
    assert len(e.connections) == 2
