"""An engine's answer on one keep-alive connection: the half of the proxy's HTTP/1.1 client
that bytes arrive at (``xhpc.proxy.engines.upstream`` holds the pool and sends the requests).

``Connection`` is the asyncio protocol of one connection; it feeds the answer being read, and
any byte that comes when none is being read closes it. ``UpstreamResponse`` (an
``xhpc.proxy.engines.upstream_api.UpstreamAnswer``) parses that answer strictly
(``xhpc.proxy.engines.http1``) and hands its body to the reader whole (``read``) or as it arrives
(``chunks``). A stream's unread bytes pause reading from the engine at ``PAUSE_AT`` until the reader
takes them; an answer read whole is read to its end, never paused, and refused over its limit
(``UpstreamAnswerTooLarge``). An answer that breaks the grammar or a limit fails with
``UpstreamProtocolError`` and closes its connection, which is so never reused; a connection
that ends before the answer is whole fails it with ``UpstreamDropped``, and a timeout with
``UpstreamReadTimeout``. The session drives the timeouts kept here (``_expired``,
``_time_out``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import cast

from xhpc.proxy.engines.http1 import DONE, HEAD, AnswerParser
from xhpc.proxy.engines.upstream_api import (
    UpstreamAnswerTooLarge,
    UpstreamDropped,
    UpstreamProtocolError,
    UpstreamReadTimeout,
)

MAX_BODY = 256 * 1024 * 1024  # an answer read whole may be this large (by default)
PAUSE_AT = 1 << 20  # a stream's unread bytes at which reading from the engine pauses


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; feeds the answer being read, if any."""

    __slots__ = ("closed", "idle_since", "key", "live", "response", "transport")

    def __init__(self, key: tuple[str, int], live: set[Connection]) -> None:
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
        self.closed = True  # the transport closes: never to be taken from the pool again
        response = self.response
        if response is not None:
            response._lost(None)
        return False

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


class UpstreamResponse(AnswerParser):
    """An engine's answer: its status and headers once they arrived; its body whole
    (``read``) or as it arrives (``chunks``)."""

    def __init__(
        self,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        stream_read_s: float | None,
        max_body: int = MAX_BODY,
    ) -> None:
        super().__init__()
        self._conn = conn
        self._loop = loop
        self._max_body = max_body
        self._whole = False  # read whole (``read``): never paused, refused over ``_max_body``
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
        if self._error is not None:
            return
        try:
            self.feed(data)
        except ValueError as err:  # http1.MalformedAnswer
            self._protocol_error(
                UpstreamProtocolError(f"the engine's answer broke HTTP/1.1: {err}")
            )
        except UpstreamProtocolError as err:  # too large
            self._protocol_error(err)

    def _protocol_error(self, err: UpstreamProtocolError) -> None:
        self._buf = b""
        self._fail(err)
        self._conn.close()

    def _on_head(self) -> None:
        if not self._head.done():
            self._head.set_result(None)

    def _on_body(self, data: bytes) -> None:
        if not data:
            return
        self._parts.append(data)
        pending = self._pending = self._pending + len(data)
        if pending > PAUSE_AT:
            if self._whole:
                if pending > self._max_body:
                    raise UpstreamAnswerTooLarge(self._max_body)
            elif not self._paused and self._conn.transport is not None:
                self._paused = True
                self._conn.transport.pause_reading()
        self._wake()

    def _on_done(self) -> None:
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _lost(self, exc: Exception | None) -> None:
        """The connection ended (``exc``: why, if it broke)."""
        if self._error is not None or self.eof():
            return
        if self._state == HEAD:
            err = UpstreamDropped("the engine closed the connection before its answer")
        else:
            err = UpstreamDropped("the engine closed the connection mid-answer")
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
        if self._state == DONE:
            return False
        read_s = self._read_s
        if read_s is None:
            return now >= self._deadline
        if self._waiter is None and self._state != HEAD:
            return False  # the reader is busy with what it got, not waiting for bytes
        return now - self._wait_since >= read_s

    def _time_out(self) -> None:
        """Fail what is read now and close the connection."""
        self._fail(UpstreamReadTimeout("the engine's answer did not come in time"))
        self._conn.close()

    def _on_timer(self) -> None:
        self._timer = None
        if self._state == DONE:
            return
        now = self._loop.time()
        if self._expired(now):
            self._time_out()
            return
        read_s = self._read_s
        if read_s is None:
            due = self._deadline
        elif self._waiter is None and self._state != HEAD:
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
        """The whole body (``UpstreamAnswerTooLarge`` over the session's ``max_body_bytes``)."""
        if not self._whole:
            self._whole = True
            if self._error is None and self._pending + self._left > self._max_body:
                self._protocol_error(UpstreamAnswerTooLarge(self._max_body))
            elif self._paused and self._conn.transport is not None:
                self._paused = False
                self._conn.transport.resume_reading()
        while self._state != DONE:
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

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (what came since the last step, joined)."""
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
            if self._state == DONE:
                return
            await self._wait()

    def close(self) -> None:
        """Stop reading this answer; its connection is not reused."""
        self._conn.close()

    @property
    def reusable(self) -> bool:
        return (
            self._state == DONE
            and self.keep_alive
            and self._error is None
            and not self._buf
            and not self._conn.closed
        )
