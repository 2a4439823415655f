"""A lean HTTP/1.1 client for the proxy's requests to engines (the app's default ``Upstream``).

aiohttp's client costs ~440k instructions per request in this process, more than the aiohttp
server, the routing and everything else together; this one does what the proxy needs with a
fraction of that: POST a body to ``http://host:port/path`` on a pooled keep-alive connection,
read the answer whole or as it arrives. It implements ``xhpc.proxy.engines.upstream_api.Upstream``
(``post(url, data=, headers=, timeout=)`` as an async context manager; the answer's ``status``,
``headers``, ``read()``, ``chunks()``, ``close()``) and fails only with that module's errors,
raised where the failure is found (no translation on the way): a refused or failed connect is
an ``UpstreamConnectError``, a connect timeout an ``UpstreamConnectTimeout``, a connection lost
before the answer is whole ``UpstreamDropped``, an answer that breaks HTTP/1.1
(``xhpc.proxy.engines.http1``: grammar and limits) an ``UpstreamProtocolError``, a whole answer over
``max_body_bytes`` an ``UpstreamAnswerTooLarge``, and a read timeout ``UpstreamReadTimeout``:
the total timeout for a whole answer, ``Timeouts.read`` between a stream's reads.

The answer is parsed strictly and read by ``xhpc.proxy.engines.upstream_conn``: a stream is paused
while its reader lags, an answer read whole is read to its end (or refused over
``max_body_bytes``). A connection goes back to the pool when its answer was read whole, without
error, and both sides keep it alive; any protocol error closes it. Idle ones are dropped after
``idle_s``, shorter than the engines' own keep-alive (uvicorn's is 5 s), and a request sent on a
reused idle connection that the engine closes (or resets) before one byte of an answer is sent
once more on a new connection: the engine never began to answer it. If that new connection cannot
be made, the engine is gone (maybe killed by this very request): the caller gets the drop,
which it does not retry elsewhere, not a connect error, which it would. URLs other than ``http://``
go through aiohttp's client (``xhpc.proxy.engines.upstream_aiohttp``), made on first use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType

from yarl import URL

from xhpc.proxy.engines.upstream_aiohttp import AiohttpUpstream, aiohttp_upstream
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    UpstreamAnswer,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDropped,
)
from xhpc.proxy.engines.upstream_conn import MAX_BODY, Connection, UpstreamResponse

logger = logging.getLogger(__name__)

IDLE_S = 4.0  # an idle pooled connection older than this is closed (uvicorn closes at 5 s)
# Timeouts of 5 s or more are checked by one watchdog every second instead of a timer per
# request (aiohttp rounds those up to whole seconds too); shorter ones get their own timer.
WATCHDOG_FROM_S = 5.0
WATCHDOG_S = 1.0
ACCEPT_IDENTITY = b"Accept-Encoding: identity\r\n"  # the body is relayed as it is


class _Target:
    """What a URL means to the pool: its host, port and the start of a request to it."""

    __slots__ = ("host", "key", "port", "start")

    def __init__(self, url: URL) -> None:
        self.host = url.raw_host or ""
        self.port = url.port or 80
        self.key = (self.host, self.port)
        self.start = (
            f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n".encode("latin-1")
            + ACCEPT_IDENTITY
        )

    def request(self, headers: Mapping[str, str], data: bytes) -> bytes:
        """The whole request: its head with ``headers``, and ``data``."""
        head = [self.start]
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if line.count("\n") != 1 or "\r" in line[:-2]:
                raise ValueError(f"header {name!r} has a line break")
            head.append(line.encode("latin-1"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(data))
        head.append(data)
        return b"".join(head)


class _Post:
    """``async with session.post(...) as response``."""

    __slots__ = ("_data", "_headers", "_response", "_session", "_target", "_timeout")

    def __init__(
        self,
        session: UpstreamSession,
        target: _Target,
        data: bytes,
        headers: Mapping[str, str],
        timeout: Timeouts,
    ) -> None:
        self._session = session
        self._target = target
        self._data = data
        self._headers = headers
        self._timeout = timeout
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        self._response = await self._session._send(
            self._target, self._data, self._headers, self._timeout
        )
        return self._response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._response is not None:
            self._session._release(self._response)


class UpstreamSession:
    """Pooled keep-alive connections to the engines (no cap, like the aiohttp session it
    replaces); an ``Upstream``.

    ``idle_s``: how long an idle connection may wait to be reused (less than the engines'
    keep-alive); ``max_body_bytes``: the largest answer read whole."""

    def __init__(self, *, idle_s: float = IDLE_S, max_body_bytes: int = MAX_BODY) -> None:
        self.idle_s = idle_s
        self.max_body_bytes = max_body_bytes
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._live: set[Connection] = set()
        self._watched: set[UpstreamResponse] = set()  # answers in flight, for the watchdog
        self._tick: asyncio.TimerHandle | None = None
        self._targets: dict[str, _Target] = {}
        self._fallback: AiohttpUpstream | None = None
        self.closed = False

    def post(
        self,
        url: str,
        *,
        data: bytes,
        headers: Mapping[str, str],
        timeout: Timeouts,
    ) -> AbstractAsyncContextManager[UpstreamAnswer]:
        """An async context manager giving the engine's answer once its head arrived."""
        target = self._targets.get(url)
        if target is None:
            parsed = URL(url)
            if parsed.scheme != "http" or not parsed.raw_host:
                if self._fallback is None:
                    self._fallback = aiohttp_upstream()
                return self._fallback.post(url, data=data, headers=headers, timeout=timeout)
            if len(self._targets) >= 4096:
                self._targets.clear()
            target = self._targets[url] = _Target(parsed)
        return _Post(self, target, data, headers, timeout)

    async def _send(
        self,
        target: _Target,
        data: bytes,
        headers: Mapping[str, str],
        timeout: Timeouts,
    ) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = target.request(headers, data)
        conn = self._pooled(target.key)
        closed: UpstreamDropped | None = None
        if conn is not None:
            response = self._start(conn, request, loop, timeout, started)
            try:
                await response._head
                return response
            except UpstreamDropped as err:
                self._release(response)
                if response.received:
                    raise
                # The engine closed the idle connection as the request went out, before one
                # byte of an answer: it never began on it. Once more, on a new connection.
                logger.debug("a reused connection to %s:%d was closed", *target.key)
                closed = err
            except BaseException:
                self._release(response)
                raise
        try:
            conn = await self._connect(loop, target, timeout)
        except UpstreamConnectError:
            if closed is not None:
                # The engine is gone, not just an idle connection: the request may have been
                # what killed it, so it is not one the caller may try on another replica.
                raise closed from None
            raise
        response = self._start(conn, request, loop, timeout, started)
        try:
            await response._head
        except BaseException:
            self._release(response)
            raise
        return response

    def _start(
        self,
        conn: Connection,
        request: bytes,
        loop: asyncio.AbstractEventLoop,
        timeout: Timeouts,
        started: float,
    ) -> UpstreamResponse:
        """Send ``request`` on ``conn``; the answer to come, its timeout kept."""
        total = timeout.total
        read_s = timeout.read if total is None else None
        response = UpstreamResponse(conn, loop, read_s, self.max_body_bytes)
        conn.response = response
        limit = total if total is not None else read_s
        if limit is not None:
            if total is not None:  # the whole answer, connecting included, within ``total``
                response._deadline = started + total
            else:  # a stream: ``read`` for the head, then for each wait for bytes
                response._wait_since = loop.time()
            if limit >= WATCHDOG_FROM_S:
                self._watch(response, loop)
            else:
                response._timer = loop.call_at(loop.time() + limit, response._on_timer)
        transport = conn.transport
        if transport is None or conn.closed:  # never so: connected, and not closed in between
            response._lost(None)
        else:
            transport.write(request)
        return response

    def _pooled(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, target: _Target, timeout: Timeouts
    ) -> Connection:
        limit = timeout.connect if timeout.connect is not None else timeout.total
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: Connection(target.key, self._live), target.host, target.port
                )
        except TimeoutError as err:
            raise UpstreamConnectTimeout(
                f"connecting to {target.host}:{target.port} timed out"
            ) from err
        except OSError as err:
            raise UpstreamConnectError(
                f"cannot connect to {target.host}:{target.port}: {err}"
            ) from err
        return conn

    def _watch(self, response: UpstreamResponse, loop: asyncio.AbstractEventLoop) -> None:
        self._watched.add(response)
        if self._tick is None:
            self._tick = loop.call_later(WATCHDOG_S, self._check_timeouts, loop)

    def _check_timeouts(self, loop: asyncio.AbstractEventLoop) -> None:
        """The watchdog: every second, fail the answers past their timeout."""
        self._tick = None
        now = loop.time()
        for response in [r for r in self._watched if r._expired(now)]:
            self._watched.discard(response)
            response._time_out()
        if self._watched and not self.closed:
            self._tick = loop.call_later(WATCHDOG_S, self._check_timeouts, loop)

    def _release(self, response: UpstreamResponse) -> None:
        """After an answer: its connection back to the pool if it can serve another one."""
        self._watched.discard(response)
        if response._timer is not None:
            response._timer.cancel()
            response._timer = None
        conn = response._conn
        if conn.response is not response:
            return
        conn.response = None
        if response.reusable and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        self.closed = True
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for conn in list(self._live):
            conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.close()
