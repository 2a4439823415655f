"""A lean HTTP/1.1 client for the proxy's requests to engines (the app's default transport).

aiohttp's client costs ~440k instructions per request in this process, more than the aiohttp
server, the routing and everything else together; this one does what the proxy needs with a
fraction of that: POST a body to ``http://host:port/path`` on a pooled keep-alive connection,
read the answer whole or as it arrives. It has the surface of ``aiohttp.ClientSession`` that
``xhpc.proxy.forward`` and ``xhpc.proxy.pd`` use (``post(url, data=, headers=, timeout=)`` as
an async context manager; ``status``, ``headers``, ``read()``, ``content.iter_any()``,
``close()``) and fails with the exceptions they handle, so the retry, breaker and timeout rules
are the same whichever transport runs: a refused or failed connect is an
``UpstreamConnectError`` (a ``ClientConnectionError``; "connect_error"), a connect timeout
``aiohttp.ConnectionTimeoutError``, a connection lost before the answer is whole
``aiohttp.ServerDisconnectedError`` or ``aiohttp.ClientPayloadError`` ("dropped"), and a read
timeout ``TimeoutError`` (504): the total timeout for a whole answer, ``sock_read`` between a
stream's reads (aiohttp's semantics).

Answers are framed by Content-Length, chunked transfer encoding or the end of the connection;
1xx interim answers are skipped. A connection goes back to the pool when its answer was read
whole and both sides keep it alive; idle ones are dropped after ``IDLE_S`` (as aiohttp's pool).
URLs other than ``http://`` go through an aiohttp session made on first use.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, cast

import aiohttp
from multidict import CIMultiDict
from yarl import URL

IDLE_S = 15.0  # an idle pooled connection older than this is closed, not reused
# Timeouts of 5 s or more are checked by one watchdog every second instead of a timer per
# request (aiohttp rounds those up to whole seconds too); shorter ones get their own timer.
WATCHDOG_FROM_S = 5.0
WATCHDOG_S = 1.0
MAX_HEAD = 64 * 1024  # status line and headers
PAUSE_AT = 1 << 20  # a stream's unread bytes at which reading from the engine pauses
ACCEPT_IDENTITY = b"Accept-Encoding: identity\r\n"  # the body is relayed as it is

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class UpstreamConnectError(aiohttp.ClientConnectionError):
    """The engine could not be connected to (refused, unreachable, no such host)."""


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


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; feeds the answer being read, if any."""

    __slots__ = ("closed", "idle_since", "key", "live", "response", "transport")

    def __init__(self, key: tuple[str, int], live: set[_Conn]) -> None:
        self.key = key
        self.live = live  # the session's open connections
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP transport (uvloop's is not an asyncio.Transport subclass); TCP_NODELAY: asyncio
        # and uvloop set it on TCP sockets
        self.transport = cast(asyncio.Transport, transport)
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        response = self.response
        if response is not None:
            response._eof()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.live.discard(self)
        response = self.response
        if response is not None:
            response._lost(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Content:
    """``response.content``: what ``iter_any`` needs."""

    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._response._iter_any()


class UpstreamResponse:
    """An engine's answer: its status and headers once they arrived; its body whole
    (``read``) or as it arrives (``content.iter_any``)."""

    def __init__(
        self, conn: _Conn, loop: asyncio.AbstractEventLoop, stream_read_s: float | None
    ) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content = _Content(self)
        self._conn = conn
        self._loop = loop
        self._buf = b""
        self._state = _HEAD
        self._left = 0  # bytes left in the body (Content-Length) or the chunk
        self._keep_alive = True
        self._parts: collections.deque[bytes] = collections.deque()
        self._pending = 0  # bytes in _parts
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = loop.create_future()
        # timeouts: the whole answer's deadline, or a stream's limit on each wait for bytes (and
        # for the head; aiohttp's sock_read); checked by the session's watchdog or a timer
        self._read_s = stream_read_s
        self._deadline = float("inf")
        self._wait_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- the connection's side ----------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        end = len(buf)
        try:
            while pos < end:
                state = self._state
                if state == _CHUNK_SIZE:
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                    pos = eol + 2
                    if size == 0:
                        self._state = _TRAILER
                    else:
                        self._left = size
                        self._state = _CHUNK_DATA
                elif state == _CHUNK_DATA:
                    take = min(self._left, end - pos)
                    self._deliver(buf[pos : pos + take] if take < end - pos or pos else buf)
                    pos += take
                    self._left -= take
                    if self._left == 0:
                        self._state = _CHUNK_END
                elif state == _CHUNK_END:
                    if end - pos < 2:
                        break
                    if buf[pos : pos + 2] != b"\r\n":
                        raise ValueError("a chunk does not end with CRLF")
                    pos += 2
                    self._state = _CHUNK_SIZE
                elif state == _LENGTH:
                    take = min(self._left, end - pos)
                    self._deliver(buf[pos : pos + take] if take < end - pos or pos else buf)
                    pos += take
                    self._left -= take
                    if self._left == 0:
                        self._finish()
                elif state == _HEAD:
                    stop = buf.find(b"\r\n\r\n", pos)
                    if stop < 0:
                        if end - pos > MAX_HEAD:
                            raise ValueError("the answer's head is too large")
                        break
                    self._parse_head(buf[pos:stop])
                    pos = stop + 4
                elif state == _TRAILER:
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    if eol == pos:
                        self._finish()
                    pos = eol + 2
                elif state == _UNTIL_CLOSE:
                    self._deliver(buf[pos:] if pos else buf)
                    pos = end
                else:  # _DONE: bytes after the answer
                    self._keep_alive = False
                    pos = end
        except ValueError as err:
            self._buf = b""
            self._fail(aiohttp.ClientPayloadError(f"malformed answer from the engine: {err}"))
            self._conn.close()
            return
        self._buf = buf[pos:] if pos < end else b""

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError("not an HTTP/1 status line")
        status = int(rest[:3])
        pairs = []
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise ValueError("a malformed header line")
            pairs.append((name, value.strip()))
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self.status = status
        headers = self.headers = CIMultiDict(pairs)
        connection = headers.get("Connection", "").lower()
        self._keep_alive = (
            "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        )
        encoding = headers.get("Transfer-Encoding")
        length = headers.get("Content-Length")
        if status in (204, 304):
            self._finish()
        elif encoding is not None and "chunked" in encoding.lower():
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._left = int(length)
            if self._left < 0:
                raise ValueError("a negative Content-Length")
            self._state = _LENGTH
            if self._left == 0:
                self._finish()
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        if not self._head.done():
            self._head.set_result(None)

    def _deliver(self, data: bytes) -> None:
        if not data:
            return
        self._parts.append(data)
        self._pending += len(data)
        if self._pending > PAUSE_AT and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._state = _DONE
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _eof(self) -> None:
        if self._state == _UNTIL_CLOSE:
            self._finish()

    def _lost(self, exc: Exception | None) -> None:
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state != _DONE:
            if self._state == _HEAD:
                err: Exception = aiohttp.ServerDisconnectedError()
            else:
                err = aiohttp.ClientPayloadError("the engine closed the connection mid-answer")
            if exc is not None:
                err.__cause__ = exc
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        if not self._head.done():
            self._head.set_exception(err)
            self._head.exception()  # retrieved: nobody may be waiting any more
        self._wake()

    def _expired(self, now: float) -> bool:
        if self._state == _DONE:
            return False
        read_s = self._read_s
        if read_s is None:
            return now >= self._deadline
        if self._waiter is None and self._state != _HEAD:
            return False  # the reader is busy with what it got, not waiting for bytes
        return now - self._wait_since >= read_s

    def _time_out(self) -> None:
        """Fail what is read now and close the connection."""
        self._fail(TimeoutError())
        self._conn.close()

    def _on_timer(self) -> None:
        self._timer = None
        if self._state == _DONE:
            return
        now = self._loop.time()
        if self._expired(now):
            self._time_out()
            return
        read_s = self._read_s
        if read_s is None:
            due = self._deadline
        elif self._waiter is None and self._state != _HEAD:
            due = now + read_s
        else:
            due = self._wait_since + read_s
        self._timer = self._loop.call_at(due, self._on_timer)

    # --- the reader's side --------------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        if self._read_s is not None:
            self._wait_since = self._loop.time()
        await waiter

    async def read(self) -> bytes:
        """The whole body."""
        while self._state != _DONE:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None:
            raise self._error
        parts = self._parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self._pending = 0
        return body

    async def _iter_any(self) -> AsyncIterator[bytes]:
        parts = self._parts
        while True:
            if parts:
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                parts.clear()
                self._pending = 0
                if self._paused and self._conn.transport is not None:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return
            await self._wait()

    def close(self) -> None:
        """Stop reading this answer; its connection is not reused."""
        self._conn.close()

    @property
    def reusable(self) -> bool:
        return (
            self._state == _DONE
            and self._keep_alive
            and self._error is None
            and not self._buf
            and not self._conn.closed
        )


class _Post:
    """``async with session.post(...) as response``."""

    __slots__ = ("_args", "_fallback", "_response", "_session")

    def __init__(
        self,
        session: UpstreamSession,
        args: tuple[Any, ...],
        fallback: AbstractAsyncContextManager[aiohttp.ClientResponse] | None = None,
    ) -> None:
        self._session = session
        self._args = args
        self._fallback = fallback
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> AnyResponse:
        if self._fallback is not None:
            return await self._fallback.__aenter__()
        self._response = await self._session._send(*self._args)
        return self._response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fallback is not None:
            await self._fallback.__aexit__(exc_type, exc, tb)
        elif self._response is not None:
            self._session._release(self._response)


AnyResponse = aiohttp.ClientResponse | UpstreamResponse
"""An engine's answer through either transport (they have the surface the proxy uses)."""


class UpstreamSession:
    """Pooled keep-alive connections to the engines (no cap, like the aiohttp session it
    replaces); ``post`` as ``aiohttp.ClientSession.post`` for what the proxy sends."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._live: set[_Conn] = set()
        self._watched: set[UpstreamResponse] = set()  # answers in flight, for the watchdog
        self._tick: asyncio.TimerHandle | None = None
        self._targets: dict[str, _Target] = {}
        self._fallback: aiohttp.ClientSession | None = None
        self.closed = False

    def post(
        self,
        url: str,
        *,
        data: bytes,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> _Post:
        """An async context manager giving the engine's answer once its head arrived."""
        target = self._targets.get(url)
        if target is None:
            parsed = URL(url)
            if parsed.scheme != "http" or not parsed.raw_host:
                cm = self._aiohttp().post(url, data=data, headers=headers, timeout=timeout)
                return _Post(self, (), cm)
            if len(self._targets) >= 4096:
                self._targets.clear()
            target = self._targets[url] = _Target(parsed)
        return _Post(self, (target, data, headers, timeout))

    def _aiohttp(self) -> aiohttp.ClientSession:
        if self._fallback is None:
            self._fallback = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._fallback

    async def _send(
        self,
        target: _Target,
        data: bytes,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        total = timeout.total
        started = loop.time()
        conn = self._pooled(target.key)
        if conn is None:
            conn = await self._connect(loop, target, timeout)
        head = [target.start]
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if line.count("\n") != 1 or "\r" in line[:-2]:
                raise ValueError(f"header {name!r} has a line break")
            head.append(line.encode("latin-1"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(data))
        head.append(data)
        read_s = timeout.sock_read if total is None else None
        response = UpstreamResponse(conn, loop, read_s)
        conn.response = response
        limit = total if total is not None else read_s
        if limit is not None:
            if total is not None:  # the whole answer, connecting included, within ``total``
                response._deadline = started + total
            else:  # a stream: sock_read for the head, then for each wait for bytes
                response._wait_since = loop.time()
            if limit >= WATCHDOG_FROM_S:
                self._watch(response, loop)
            else:
                response._timer = loop.call_at(loop.time() + limit, response._on_timer)
        assert conn.transport is not None
        conn.transport.write(b"".join(head))
        try:
            await response._head
        except BaseException:
            self._release(response)
            raise
        return response

    def _pooled(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, target: _Target, timeout: aiohttp.ClientTimeout
    ) -> _Conn:
        limit = timeout.connect if timeout.connect is not None else timeout.total
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: _Conn(target.key, self._live), target.host, target.port
                )
        except TimeoutError as err:
            raise aiohttp.ConnectionTimeoutError(
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
