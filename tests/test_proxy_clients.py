"""What the gateway allows one client (decision 0013): a request's head and body must arrive in
time (half-sent requests are closed, with a 408 where one can be read), a worker serves at most
``max_connections`` connections (one more gets a 503 at once), the open-files limit is raised to
what the connections need, and what breaks HTTP/1.1 is answered OpenAI-shaped with no traceback.

Clients are raw sockets: no HTTP library sends half a request or a 60 kB header on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from tests.proxy_fakes import Stack, assert_openai_error, chat, open_stack
from xhpc.endpoints import ENDPOINTS
from xhpc.gateway_settings import BODY_LIMITS
from xhpc.proxy import bound_url, make_app
from xhpc.proxy.process.server import app_runner
from xhpc.proxy.tenants.limits import FD_LIMIT_IF_UNLIMITED, ClientLimits, raise_fd_limit
from xhpc.settings import ProxyConfig, XhpcConfig

pytestmark = pytest.mark.security

CHAT = json.dumps(chat()).encode()
FAST = {"client_header_timeout_s": 0.5, "client_body_timeout_s": 1.0}


@contextlib.asynccontextmanager
async def gateway(stack: Stack, **proxy: Any) -> AsyncIterator[str]:
    """The stack's router served as `xhpc proxy` serves it (``app_runner``), with ``proxy``
    settings; yields its URL."""
    config = XhpcConfig(proxy=ProxyConfig(auth="none", **proxy))
    runner = app_runner(make_app(stack.router, config=config.proxy), config, 1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield bound_url(runner)
    finally:
        await runner.cleanup()


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        await s.engine("a")
        s.publish("a")
        yield s


class Raw:
    """One client connection on a raw socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> Raw:
        parts = urlsplit(url)
        return cls(*await asyncio.open_connection(parts.hostname, parts.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_closed(self, timeout_s: float = 5.0) -> bytes:
        """Every byte the proxy sends until it closes the connection."""
        async with asyncio.timeout(timeout_s):
            return await self.reader.read()

    async def answer(self, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        """One answer with a Content-Length (the connection may stay open)."""
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status, headers = parse_head(head)
            body = await self.reader.readexactly(int(headers["content-length"]))
        return status, headers, body

    def close(self) -> None:
        self.writer.close()


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """A whole answer read until the connection closed: status, headers, JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    return status, headers, json.loads(body)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logged = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not logged, [r.getMessage() for r in logged]


async def served(stack: Stack) -> None:
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 200, body


# --- slow clients ---


async def test_half_sent_requests_are_closed_in_time_while_a_normal_client_is_served(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    async with gateway(stack, **FAST) as url:
        stack.url = url
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        silent = [await Raw.open(url) for _ in range(20)]
        # Each half-sent request is sent as soon as its connection is open: on a loaded machine
        # opening 180 connections first could outlast the header timeout, and a connection that
        # sent nothing by then is rightly closed with no answer.
        heads, bodies = [], []
        for _ in range(90):
            heads.append(raw := await Raw.open(url))
            await raw.send(head + b"Content-Le")
        for _ in range(90):
            bodies.append(raw := await Raw.open(url))
            await raw.send(head + b"Content-Length: %d\r\n\r\n" % len(CHAT) + CHAT[:10])
        started = time.monotonic()
        for _ in range(10):  # the proxy keeps serving while they wait
            await served(stack)
        outcomes = await asyncio.gather(*(r.until_closed() for r in silent + heads + bodies))
        took = time.monotonic() - started
        assert took < 4.0  # body timeout 1 s, checked every 0.125 s; a busy machine
        assert set(outcomes[:20]) == {b""}  # nothing asked, nothing answered
        for raw in outcomes[20:]:
            status, headers, body = parse(raw)
            assert status == 408 and headers["connection"] == "close"
            assert_openai_error(body, "request_timeout")
        assert "head" in parse(outcomes[20])[2]["error"]["message"]
        assert "body" in parse(outcomes[-1])[2]["error"]["message"]
        await served(stack)
    assert len(stack.engines["a"].received) == 11  # the half-sent bodies never left the proxy
    no_traceback(caplog)


async def test_a_kept_alive_connection_may_idle_but_must_send_its_next_head_in_time(
    stack: Stack,
) -> None:
    async with gateway(stack, **FAST, client_keepalive_timeout_s=2.0) as url:
        raw = await Raw.open(url)
        get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        await raw.send(get)
        assert (await raw.answer())[0] == 200
        await asyncio.sleep(1.0)  # idle past the head's timeout: kept alive
        await raw.send(get)
        assert (await raw.answer())[0] == 200
        await raw.send(b"GET /health HTTP/1.1\r\n")  # then half a head
        started = time.monotonic()
        status, _, body = parse(await raw.until_closed())
        assert status == 408 and time.monotonic() - started < 1.5
        assert_openai_error(body, "request_timeout")
        idle = await Raw.open(url)
        await idle.send(get)
        assert (await idle.answer())[0] == 200
        started = time.monotonic()
        assert await idle.until_closed() == b""  # idle past the keep-alive timeout
        assert 1.0 < time.monotonic() - started < 3.5


# --- the connection cap ---


async def test_connections_over_the_cap_get_a_503_at_once_and_the_others_are_served(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    async with gateway(stack, max_connections=3) as url:
        stack.url = url
        held = []
        for _ in range(3):  # each one served, so that the proxy counts it before the next
            raw = await Raw.open(url)
            await raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await raw.answer())[0] == 200
            held.append(raw)
        started = time.monotonic()
        over = await Raw.open(url)
        await over.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        status, headers, body = parse(await over.until_closed())
        assert time.monotonic() - started < 2.0
        assert status == 503 and headers["retry-after"] == "1"
        assert_openai_error(body, "too_many_connections")
        assert "refused 1 connection(s) over proxy.max_connections (3" in caplog.text
        for raw in held:  # the connections within the cap go on
            await raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await raw.answer())[0] == 200
        held.pop().close()
        await asyncio.sleep(0.1)
        await served(stack)  # a place is free again
    assert len(stack.engines["a"].received) == 1


def test_the_cap_is_lowered_to_what_the_descriptors_carry(caplog: pytest.LogCaptureFixture) -> None:
    limits = ClientLimits(max_connections=10_000)
    assert limits.within_fds(1 << 20) is limits
    assert limits.within_fds(1024).max_connections == (1024 - 64) // 2
    assert "proxy.max_connections = 10000 needs 20064 file descriptors" in caplog.text


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT_IF_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    low = min(256, target)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        assert raise_fd_limit() == target
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (target, hard)
        assert raise_fd_limit() == target  # again: nothing to do
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- the HTTP layer's own errors ---

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n"
BROKEN = {
    "a 60 kB header": (GET + b"X-Big: " + b"a" * 60_000 + b"\r\n\r\n", 431),
    "a 10 kB request line": (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    "200 headers": (GET + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", 431),
    "a malformed request line": (b"GARBAGE\r\n\r\n", 400),
    "a bad method": (b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "an unknown HTTP version": (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    "TLS on the plain port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 400),
    "a header name with a space": (GET + b"Bad Header: y\r\n\r\n", 400),
    "a bad Content-Length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        400,
    ),
    "bad chunks": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n",
        400,
    ),
    "both Content-Length and chunks": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
}


@pytest.mark.parametrize("case", BROKEN)
async def test_what_breaks_http_is_answered_openai_shaped_in_one_log_line(
    stack: Stack, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    data, want = BROKEN[case]
    caplog.set_level(logging.INFO)
    async with gateway(stack) as url:
        stack.url = url
        raw = await Raw.open(url)
        await raw.send(data)
        answer = await raw.until_closed()
        status, headers, body = parse(answer)
        assert status == want
        assert headers["content-type"].startswith("application/json")
        code = "request_header_fields_too_large" if want == 431 else "bad_http_request"
        assert_openai_error(body, code)
        assert len(answer) < 1024  # no client bytes echoed at length
        await served(stack)
    no_traceback(caplog)
    assert len([r for r in caplog.records if r.getMessage().startswith("bad request")]) == 1
    assert len(stack.engines["a"].received) == 1  # only the good request


async def test_a_body_whose_chunks_break_midway_ends_within_the_body_timeout(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp's parser drops such a body without telling its reader: the body's deadline ends it
    async with gateway(stack, **FAST) as url:
        stack.url = url
        raw = await Raw.open(url)
        await raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await asyncio.sleep(0.1)
        await raw.send(b"zz\r\nabc\r\n0\r\n\r\n")
        status, _, body = parse(await raw.until_closed(3.0))
        assert status in (400, 408)
        assert_openai_error(body, "request_timeout" if status == 408 else "invalid_request_body")
        await served(stack)
    no_traceback(caplog)


# --- body limits per path ---


async def test_a_20_mb_body_to_chat_is_refused_413_before_it_is_read(stack: Stack) -> None:
    async with gateway(stack) as url:
        stack.url = url
        raw = await Raw.open(url)
        size = 20 * 1024 * 1024
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        await raw.send(head % size + b"x" * 65536)  # the rest is never sent
        status, _, body = await raw.answer(2.0)
        assert status == 413
        error = json.loads(body)
        assert_openai_error(error, "request_too_large")
        assert str(4 * 1024 * 1024) in error["error"]["message"]
        raw.close()
        await served(stack)
    assert len(stack.engines["a"].received) == 1  # only the good request


async def test_each_path_has_its_own_body_limit_chunked_bodies_included(stack: Stack) -> None:
    limits = {"/v1/chat/completions": 2000}
    async with gateway(stack, body_limits=limits) as url:
        stack.url = url
        big = chat(pad="x" * 3000)
        status, _, body = await stack.post("/v1/chat/completions", big)
        assert status == 413
        assert_openai_error(body, "request_too_large")

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read up to the limit
            data = json.dumps(big).encode()
            for i in range(0, len(data), 500):
                yield data[i : i + 500]

        async with stack.client.post(url + "/v1/chat/completions", data=chunks()) as resp:
            assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
            assert resp.status == 413
        embed = {"model": "m", "input": "x" * 3000}  # the embeddings limit is untouched
        status, _, body = await stack.post("/v1/embeddings", embed)
        assert status == 200, body
    assert [r["input"] for r in stack.engines["a"].received] == [embed["input"]]


def test_body_limits_are_checked_and_completed_from_the_defaults() -> None:
    config = ProxyConfig(body_limits={"/v1/embeddings": 1000})
    assert config.body_limits == {**BODY_LIMITS, "/v1/embeddings": 1000}
    assert BODY_LIMITS["/v1/chat/completions"] == 4 * 1024 * 1024
    assert set(BODY_LIMITS) == set(ENDPOINTS)  # every forwarded path has its limit
    assert config.body_limit("/v1/embeddings") == 1000
    assert ProxyConfig(max_body_bytes=100).body_limit("/v1/chat/completions") == 100
    with pytest.raises(ValueError, match="valid paths: /v1/chat/completions"):
        ProxyConfig(body_limits={"/v1/nope": 1})
    with pytest.raises(ValueError, match="greater than 0"):
        ProxyConfig(body_limits={"/v1/completions": 0})
    for key in ("client_header_timeout_s", "client_body_timeout_s", "max_connections"):
        with pytest.raises(ValueError):
            ProxyConfig(**{key: 0})
