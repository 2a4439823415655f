"""The proxy's own HTTP/1.1 client (xhpc.proxy.engines.upstream) against scripted engines on
loopback: framing, connection reuse, and the failures the forwarder tells apart (connect error,
dropped, broken answer, timeout), raised as the errors of the upstream seam
(xhpc.proxy.engines.upstream_api)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from tests.proxy_fakes import scripted_engine as engine
from xhpc.proxy.engines.upstream import UpstreamSession
from xhpc.proxy.engines.upstream_aiohttp import aiohttp_upstream
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    Upstream,
    UpstreamConnectError,
    UpstreamDropped,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReadTimeout,
    UpstreamTimeout,
)

TIMEOUT = Timeouts(total=5, connect=5)
STREAM_TIMEOUT = Timeouts(connect=5, read=5)
HEADERS = {"Content-Type": "application/json"}


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


OK_BODY = b'{"id": "x", "usage": {"prompt_tokens": 1}}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(OK_BODY),
    OK_BODY,
)
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS)
    + b"0\r\nX-Trailer: 1\r\n\r\n"
)


@pytest.mark.parametrize("size", [1, 3, 7, 64, 4096])
async def test_content_length_body_in_any_pieces(size: int) -> None:
    async with engine(lambda _: pieces(OK, size)) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b'{"a": 1}', headers=HEADERS, timeout=TIMEOUT) as r:
            assert r.status == 200
            assert r.headers["content-type"] == "application/json"
            assert await r.read() == OK_BODY
        await session.close()
    sent = e.requests[0]
    assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Type: application/json\r\n" in sent
    assert b"\r\nContent-Length: 8\r\n\r\n" in sent
    assert sent.endswith(b'{"a": 1}')


@pytest.mark.parametrize("size", [1, 5, 13, 4096])
async def test_chunked_stream_arrives_whole_and_in_order(size: int) -> None:
    async with engine(lambda _: pieces(CHUNKED, size)) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=STREAM_TIMEOUT) as r:
            assert r.status == 200
            got = b"".join([chunk async for chunk in r.chunks()])
        await session.close()
    assert got == b"".join(EVENTS)


async def test_interim_answers_are_skipped_and_the_connection_is_reused() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    async with engine(lambda _: [interim, OK]) as e:
        session = UpstreamSession()
        for _ in range(3):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
                assert r.status == 200
                assert await r.read() == OK_BODY
        await session.close()
    assert len(e.requests) == 3
    assert len(e.connections) == 1  # keep-alive


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
)
async def test_a_connection_the_engine_closes_is_not_reused(answer: bytes) -> None:
    async with engine(lambda _: [answer]) as e:
        session = UpstreamSession()
        for _ in range(2):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
                assert await r.read() == b"ok"
        await session.close()
    assert len(e.connections) == 2


async def test_body_until_the_connection_closes() -> None:
    answer = [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello ", b"world", b"<close>"]
    async with engine(lambda _: answer) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            assert await r.read() == b"hello world"
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            assert await r.read() == b"hello world"
        await session.close()
    assert len(e.connections) == 2


async def test_an_idle_connection_the_engine_closed_is_not_used() -> None:
    async with engine(lambda _: [OK]) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            await r.read()
        e.connections[0].transport.close()  # the engine's keep-alive timeout
        await asyncio.sleep(0.05)
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            assert await r.read() == OK_BODY
        await session.close()
    assert len(e.connections) == 2


async def test_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    session = UpstreamSession()
    with pytest.raises(UpstreamConnectError) as info:
        async with session.post(
            f"http://127.0.0.1:{port}/v1/x", data=b"{}", headers=HEADERS, timeout=TIMEOUT
        ):
            pass
    assert not isinstance(info.value, UpstreamTimeout)
    await session.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ([b"<close>"], UpstreamDropped),
        ([b"HTTP/1.1 200 OK\r\nContent-Le"[:20], b"<close>"], UpstreamDropped),
        ([OK[:-5], b"<close>"], UpstreamDropped),
        ([b"garbage\r\n\r\n"], UpstreamProtocolError),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
            UpstreamProtocolError,
        ),
    ],
)
async def test_a_broken_answer_is_an_upstream_error(
    answer: list[bytes], error: type[UpstreamError]
) -> None:
    async with engine(lambda _: answer) as e:
        session = UpstreamSession()
        with pytest.raises(error):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
                await r.read()
        await session.close()


async def test_stream_broken_mid_way_raises_after_the_bytes_that_came() -> None:
    head, _, _ = CHUNKED.partition(b"\r\n\r\n")
    first = b"%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0])
    async with engine(lambda _: [head + b"\r\n\r\n" + first, b"<close>"]) as e:
        session = UpstreamSession()
        got = []
        with pytest.raises(UpstreamDropped):
            async with session.post(
                e.url, data=b"{}", headers=HEADERS, timeout=STREAM_TIMEOUT
            ) as r:
                async for chunk in r.chunks():
                    got.append(chunk)
        await session.close()
    assert got == [EVENTS[0]]


async def test_total_timeout_is_a_timeout_error() -> None:
    async with engine(lambda _: [b"<sleep 5>"]) as e:
        session = UpstreamSession()
        timeout = Timeouts(total=0.2, connect=1)
        with pytest.raises(UpstreamReadTimeout):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=timeout) as r:
                await r.read()
        await session.close()


async def test_stream_read_timeout_counts_from_the_last_bytes() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    slow = [head] + [b"2\r\nab\r\n", b"<sleep 0.15>"] * 3 + [b"<sleep 5>"]
    async with engine(lambda _: slow) as e:
        session = UpstreamSession()
        timeout = Timeouts(connect=1, read=0.3)
        got = b""
        with pytest.raises(UpstreamReadTimeout):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=timeout) as r:
                async for chunk in r.chunks():
                    got += chunk
        await session.close()
    assert got == b"ababab"  # 0.45 s in all, never 0.3 s between bytes


async def test_header_values_cannot_inject_lines() -> None:
    async with engine(lambda _: [OK]) as e:
        session = UpstreamSession()
        with pytest.raises(ValueError):
            async with session.post(
                e.url, data=b"{}", headers={"X-Request-Id": "a\r\nX-Evil: 1"}, timeout=TIMEOUT
            ):
                pass
        await session.close()


async def test_close_closes_every_connection() -> None:
    async with engine(lambda _: [OK]) as e:
        session = UpstreamSession()
        async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT) as r:
            await r.read()
        await session.close()
        await asyncio.sleep(0.05)
        assert e.connections[0].transport.is_closing()
        assert session.closed


@pytest.mark.parametrize("stream", [False, True])
async def test_long_timeouts_are_kept_by_the_watchdog(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setattr("xhpc.proxy.engines.upstream.WATCHDOG_FROM_S", 0.0)
    monkeypatch.setattr("xhpc.proxy.engines.upstream.WATCHDOG_S", 0.05)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = [head, b"2\r\nab\r\n", b"<sleep 0.1>", b"2\r\ncd\r\n", b"<sleep 5>"]
    timeout = Timeouts(connect=1, read=0.3) if stream else Timeouts(total=0.4, connect=1)
    async with engine(lambda _: answer) as e:
        session = UpstreamSession()
        got = b""
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UpstreamReadTimeout):
            async with session.post(e.url, data=b"{}", headers=HEADERS, timeout=timeout) as r:
                async for chunk in r.chunks():
                    got += chunk
        assert 0.35 <= loop.time() - started < 2.0
        assert got == b"abcd"
        # answers in time are not failed by it
        async with engine(lambda _: [OK]) as fine:
            for _ in range(3):
                async with session.post(
                    fine.url, data=b"{}", headers=HEADERS, timeout=timeout
                ) as r:
                    assert await r.read() == OK_BODY
                await asyncio.sleep(0.1)
        assert not session._watched
        await session.close()


# --- the seam: both clients fail with the same errors -------------------------------------------

CLIENTS: dict[str, Callable[[], Upstream]] = {
    "own": UpstreamSession,
    "aiohttp": aiohttp_upstream,
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize(
    ("answer", "stream", "error"),
    [
        ([b"<close>"], False, UpstreamDropped),  # the request went out; no answer
        ([OK[:-5], b"<close>"], False, UpstreamDropped),  # a body cut short
        ([CHUNKED[:-40], b"<close>"], True, UpstreamDropped),  # a stream cut short
        ([b"garbage\r\n\r\n"], False, UpstreamProtocolError),  # not an HTTP answer
        ([b"<sleep 5>"], False, UpstreamReadTimeout),  # no answer within the total timeout
        ([CHUNKED[:120], b"<sleep 5>"], True, UpstreamReadTimeout),  # a stream that stalls
    ],
)
async def test_both_clients_fail_with_the_seams_errors(
    client: str, answer: list[bytes], stream: bool, error: type[UpstreamError]
) -> None:
    timeout = Timeouts(connect=1, read=0.3) if stream else Timeouts(total=0.3, connect=1)
    upstream = CLIENTS[client]()
    async with engine(lambda _: answer) as e:
        with pytest.raises(error) as info:
            async with upstream.post(e.url, data=b"{}", headers=HEADERS, timeout=timeout) as r:
                if stream:
                    async for _ in r.chunks():
                        pass
                else:
                    await r.read()
        await upstream.close()
    if error is UpstreamDropped:
        assert not isinstance(info.value, UpstreamConnectError | UpstreamTimeout)


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_both_clients_tell_a_refused_connect_apart(client: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    upstream = CLIENTS[client]()
    url = f"http://127.0.0.1:{port}/v1/x"
    with pytest.raises(UpstreamConnectError) as info:
        async with upstream.post(url, data=b"{}", headers=HEADERS, timeout=TIMEOUT):
            pass
    assert not isinstance(info.value, UpstreamTimeout)  # never reached: safe to send elsewhere
    await upstream.close()


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_both_clients_answer_alike(client: str) -> None:
    upstream = CLIENTS[client]()
    async with engine(lambda _: [OK]) as e:
        whole = upstream.post(e.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT)
        async with whole as r:
            assert (r.status, r.headers["content-type"]) == (200, "application/json")
            assert await r.read() == OK_BODY
    async with engine(lambda _: [CHUNKED]) as e:
        stream = upstream.post(e.url, data=b"{}", headers=HEADERS, timeout=STREAM_TIMEOUT)
        async with stream as r:
            assert b"".join([chunk async for chunk in r.chunks()]) == b"".join(EVENTS)
    await upstream.close()
