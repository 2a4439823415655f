"""The gateway's side that faces clients: its connections and what each may hold (decision 0013).

aiohttp's own server keeps a connection that sends half a request for as long as it likes
(slowloris), accepts connections until the process runs out of descriptors, and answers what
breaks HTTP/1.1 in plain text, with a traceback in the log. ``GatewayRunner`` serves an aiohttp
app with, per connection (``ClientLimits``):

- a deadline for a request's head: ``header_timeout_s`` from the connection's start (after its
  TLS handshake), or from the first byte of the next request on a kept-alive connection. A
  client that misses it is answered 408 (if it had begun that request) and closed;
- a deadline for its body: ``body_timeout_s`` after its head. The handler reading it gets the
  408 (``xhpc.proxy.tenants.limits.read_body`` raises it), and the connection is closed after that
  answer; a body nobody reads any more is cut there too;
- an idle kept-alive connection is closed after ``keepalive_timeout_s`` (aiohttp's timer);
- at most ``max_connections`` connections per worker: one more is answered 503 at once (and
  closed after a short linger, so that the answer is read, not reset); it never waits;
- the HTTP layer's own errors (a 60 kB header, a malformed request line, too many headers,
  broken chunks read with the head) are answered OpenAI-shaped with their status (400, 431),
  with one log line and no traceback.

The deadlines are checked by one sweep per server every ``ClientLimits.sweep_s``, not by a timer
per request. The app itself runs unchanged: ``GatewayRunner`` starts and stops it with an
``AppRunner``, and serves its handler and request factory from a ``GatewayServer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from http import HTTPStatus
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpProcessingError, RawRequestMessage
from aiohttp.http_exceptions import LineTooLong

from xhpc.errors import error_body
from xhpc.proxy.errors import ProxyHTTPError, clipped, request_timeout
from xhpc.proxy.tenants.limits import ClientLimits

logger = logging.getLogger(__name__)

REFUSED_LINGER_S = 1.0  # a refused connection reads (and drops) its request this long
REFUSALS_LOG_S = 10.0  # refusals are logged at most once in this long
# What a client did that ends its connection: logged in one line, never with a traceback.
CLIENT_FAULTS = (HttpProcessingError, web.RequestPayloadError, ConnectionError)


def raw_answer(err: ProxyHTTPError) -> bytes:
    """``err`` as a whole HTTP/1.1 answer that closes its connection, for a connection that has
    no request to answer through aiohttp (its head is late, or it is refused)."""
    body = json.dumps(error_body(err.message, type_=err.type, code=err.code)).encode()
    lines = [
        f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in err.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def http_error(exc: BaseException | None, status: int) -> ProxyHTTPError:
    """The OpenAI-shaped answer to an error of the HTTP layer (``status`` is aiohttp's)."""
    if isinstance(exc, LineTooLong):
        return ProxyHTTPError(
            431,
            f"the request line or a header is longer than {exc.args[1]} bytes",
            type_="invalid_request_error",
            code="request_header_fields_too_large",
        )
    if isinstance(exc, HttpProcessingError):
        first = exc.message.strip().split("\n", 1)[0].rstrip(":")
        if first.startswith("Too many headers"):
            return ProxyHTTPError(
                431,
                "the request has too many headers",
                type_="invalid_request_error",
                code="request_header_fields_too_large",
            )
        return ProxyHTTPError(
            400,
            f"malformed HTTP request: {clipped(first)}",
            type_="invalid_request_error",
            code="bad_http_request",
        )
    if status == 504:  # a handler's TimeoutError
        return ProxyHTTPError(504, "the proxy timed out", type_="server_error", code="timeout")
    return ProxyHTTPError(500, "internal proxy error", type_="server_error", code="internal_error")


def _one_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return clipped(f"{type(exc).__name__}: {str(text).strip().splitlines()[0] if text else ''}")


class GatewayProtocol(web.RequestHandler):
    """One client connection: aiohttp's, with the deadlines and error answers above."""

    __slots__ = (
        "body",
        "body_deadline",
        "busy",
        "cut",
        "gateway",
        "head_deadline",
        "head_started",
        "now",
    )

    def __init__(
        self, manager: GatewayServer, *, loop: asyncio.AbstractEventLoop, **kwargs: Any
    ) -> None:
        super().__init__(
            manager, loop=loop, keepalive_timeout=manager.limits.keepalive_timeout_s, **kwargs
        )
        self.gateway = manager
        self.now = loop.time
        self.head_deadline: float | None = None  # the head being read must be whole by then
        self.head_started = False  # a byte of that head has arrived
        self.body: StreamReader | None = None  # the body of the request in hand, if unread
        self.body_deadline: float | None = None
        self.busy = False  # a request is being answered
        self.cut = False  # its body came too late: close once it is answered

    @property
    def waiting(self) -> bool:
        """Between requests: no request being answered, no byte of the next one yet."""
        return not self.busy and not self.head_started

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.head_deadline = self.now() + self.gateway.limits.header_timeout_s

    def data_received(self, data: bytes) -> None:
        if not self.head_started and not self.busy and data:
            body = self.body
            if body is None or body.is_eof():  # not the rest of an unread body: a new head
                self.body = self.body_deadline = None
                self.head_started = True
                if self.head_deadline is None:
                    self.head_deadline = self.now() + self.gateway.limits.header_timeout_s
        super().data_received(data)

    def head_done(self, payload: StreamReader) -> None:
        """A request's head has been read whole (its handler is about to run)."""
        self.head_deadline = None
        self.head_started = False
        self.busy = True
        if payload.is_eof():
            self.body = self.body_deadline = None
        else:
            self.body = payload
            self.body_deadline = self.now() + self.gateway.limits.body_timeout_s

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if self.cut:
            resp.force_close()  # says `Connection: close`, if its head is still to be sent
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.busy = False
            body = self.body
            if self.cut:
                self.force_close()  # after the answer: its bytes are written before the close
            elif body is not None and body.is_eof():
                self.body = self.body_deadline = None

    def check(self, now: float) -> None:
        """Act on a deadline that has passed (called by the server's sweep)."""
        if self.head_deadline is not None and now >= self.head_deadline:
            self.head_deadline = None
            if self.busy or self.transport is None:
                return
            if self.head_started:
                limit = self.gateway.limits.header_timeout_s
                self.transport.write(raw_answer(request_timeout("head", limit)))
            logger.debug("closed a connection from %s: no whole request head", self.peername)
            self.force_close()
        elif self.body_deadline is not None and now >= self.body_deadline:
            self.body_deadline = None
            body = self.body
            if body is None or body.is_eof():
                return
            logger.debug("cut a request body from %s: it came too slowly", self.peername)
            self.cut = True
            if self.busy:  # its handler gets the 408 from its read, and answers it
                body.set_exception(request_timeout("body", self.gateway.limits.body_timeout_s))
            else:  # answered already; aiohttp is reading the rest to drop it
                self.force_close()
                body.feed_eof()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse, or whose handler raised: here
        OpenAI-shaped, and logged in one line unless it is the proxy's own fault."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was begun already; it cannot become an error")
        err = http_error(exc, status)
        if isinstance(exc, CLIENT_FAULTS):
            logger.info("bad request from %s: %s", request.remote, err.message)
        elif status == 504:
            logger.warning("a request from %s timed out in the proxy", request.remote)
        else:
            logger.error("unexpected error answering %s", request.remote, exc_info=exc)
        resp = err.response()
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, CLIENT_FAULTS):  # e.g. a broken body aiohttp was reading to drop
            logger.info("connection from %s ended: %s", self.peername, _one_line(exc))
            return
        super().log_exception(*args, **kw)


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, its request read and dropped for
    ``REFUSED_LINGER_S`` (closing with unread bytes would reset it, and the client could lose
    the answer), then closed."""

    def __init__(self, server: GatewayServer) -> None:
        self.server = server
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.server.refusal)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = self.server.loop.call_later(REFUSED_LINGER_S, transport.close)
        self.server.refused()

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool | None:
        return None  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class GatewayServer(web.Server):
    """aiohttp's server for one app, whose connections are ``GatewayProtocol``s (or refused)."""

    def __init__(
        self,
        app_server: web.Server,
        limits: ClientLimits,
        *,
        access_log: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(app_server.request_handler, request_factory=self._request, loop=loop)
        self.app_request = app_server.request_factory
        self.limits = limits
        self.loop = loop
        self.handler_kwargs: dict[str, Any] = {} if access_log else {"access_log": None}
        self.open = 0  # connections served (refused ones are not)
        busy = ProxyHTTPError(
            503,
            f"the proxy serves its limit of {limits.max_connections} connections; retry later",
            type_="service_unavailable",
            code="too_many_connections",
            headers={"Retry-After": "1"},
        )
        self.refusal = raw_answer(busy)
        self._refused = 0
        self._refusals_logged_at = -math.inf
        self._sweeper: asyncio.TimerHandle | None = None

    def __call__(self) -> web.RequestHandler | asyncio.Protocol:  # type: ignore[override]
        """A protocol for a new connection (asyncio calls the server for each)."""
        if self.open >= self.limits.max_connections:
            return _Refused(self)
        return GatewayProtocol(self, loop=self.loop, **self.handler_kwargs)

    def _request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        if isinstance(protocol, GatewayProtocol):
            protocol.head_done(payload)
        return self.app_request(message, payload, protocol, writer, task)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open += 1
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.limits.sweep_s, self._sweep)

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        super().connection_lost(handler, exc)
        self.open -= 1

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.loop.time()
        for conn in self.connections:
            if isinstance(conn, GatewayProtocol):
                conn.check(now)
        if self.open > 0:
            self._sweeper = self.loop.call_later(self.limits.sweep_s, self._sweep)

    def refused(self) -> None:
        self._refused += 1
        now = self.loop.time()
        if now - self._refusals_logged_at >= REFUSALS_LOG_S:
            self._refusals_logged_at = now
            logger.warning(
                "refused %d connection(s) over proxy.max_connections (%d per worker) with 503",
                self._refused,
                self.limits.max_connections,
            )
            self._refused = 0

    async def shutdown(self, timeout: float | None = None) -> None:
        await super().shutdown(timeout)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


class GatewayRunner(web.BaseRunner):
    """Serves ``app`` (its sites: ``web.TCPSite``, ``web.SockSite``, with TLS or not) through a
    ``GatewayServer``. The app starts with ``setup`` and stops with ``cleanup``, once its
    connections are done (handlers get ``shutdown_timeout_s``)."""

    def __init__(
        self,
        app: web.Application,
        limits: ClientLimits,
        *,
        access_log: bool = False,
        shutdown_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(shutdown_timeout=shutdown_timeout_s)
        self.limits = limits
        self.access_log = access_log
        self.app_runner = web.AppRunner(app, access_log=None)  # the app's start and stop only

    async def shutdown(self) -> None:
        """Nothing before the connections close: the app's own shutdown runs with its cleanup,
        after them (its upstream session serves the handlers still finishing)."""

    async def _make_server(self) -> web.Server:
        await self.app_runner.setup()
        app_server = self.app_runner.server
        if app_server is None:
            raise RuntimeError("the app runner made no server")
        loop = asyncio.get_running_loop()
        return GatewayServer(app_server, self.limits, access_log=self.access_log, loop=loop)

    async def _cleanup_server(self) -> None:
        await self.app_runner.cleanup()
