"""The proxy's seam to engines: what an HTTP client must do for it, and how it may fail.

``Upstream`` is all the forwarder (``xhpc.proxy.forward``), the PD route (``xhpc.proxy.pd``)
and the context-length probe (``xhpc.proxy.engines.contexts``) need of a client: POST a body to a
URL with a ``Timeouts``, as an async context manager giving an ``UpstreamAnswer`` once its head
arrived, whose body is read whole (``read``) or as it arrives (``chunks``). Two clients
implement it: the proxy's own (``xhpc.proxy.engines.upstream.UpstreamSession``, the default) and a
thin adapter over aiohttp's (``xhpc.proxy.engines.upstream_aiohttp.AiohttpUpstream``).

Every failure of either is one of the errors below, never the client's own, so the retry,
breaker and timeout rules are written once, against what a failure means for the request:

    UpstreamError
      UpstreamConnectError       the request never reached the engine: safe to send elsewhere
        UpstreamConnectTimeout   ... because connecting took too long (also an UpstreamTimeout)
      UpstreamTimeout            the engine was too slow
        UpstreamConnectTimeout
        UpstreamReadTimeout      the request was sent; the answer (or a stream's next bytes)
                                 did not come in time
      UpstreamDropped            the connection broke after the request was sent: the engine
                                 may have it (never sent elsewhere)
      UpstreamProtocolError      the engine's answer broke HTTP/1.1 or the proxy's limits on it
        UpstreamAnswerTooLarge   a whole answer over the proxy's limit

This module imports no HTTP library: the seam is the proxy's, not a client's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long an exchange with an engine may take, in seconds (None: no limit).

    ``total``: the whole answer, connecting included (an answer read whole); ``connect``:
    making the connection (else ``total`` bounds it); ``read``: with no ``total``, the wait
    for the answer's head and then each wait for a stream's next bytes."""

    total: float | None = None
    connect: float | None = None
    read: float | None = None


class UpstreamError(Exception):
    """An exchange with an engine failed; the subclass says how far it got."""


class UpstreamConnectError(UpstreamError):
    """The engine could not be connected to (refused, unreachable, no such host): the request
    never reached it."""


class UpstreamTimeout(UpstreamError):
    """The engine did not do its part in time."""


class UpstreamConnectTimeout(UpstreamConnectError, UpstreamTimeout):
    """Connecting to the engine timed out: the request never reached it."""


class UpstreamReadTimeout(UpstreamTimeout):
    """The request was sent and the answer did not come in time: the whole answer within its
    total timeout, or a stream's next bytes within its read timeout."""


class UpstreamDropped(UpstreamError):
    """The connection ended after the request went out and before the answer was whole: the
    engine may have taken the request (and may be what it broke)."""


class UpstreamProtocolError(UpstreamError):
    """The engine's answer broke HTTP/1.1 or the proxy's limits on it
    (``xhpc.proxy.engines.http1``); its connection is closed, never reused. ``code`` names it in the
    gateway's 502."""

    code = "upstream_bad_answer"


class UpstreamAnswerTooLarge(UpstreamProtocolError):
    """An answer read whole that is over the proxy's limit on answers."""

    code = "upstream_answer_too_large"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the engine's answer is larger than the proxy's limit of {limit} bytes")


class UpstreamAnswer(Protocol):
    """An engine's answer: its status and headers (case-insensitive) once its head arrived."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        ...

    def close(self) -> None:
        """Stop reading; the connection is not reused."""
        ...


class Upstream(Protocol):
    """An HTTP client to engines (pooled keep-alive connections)."""

    def post(
        self, url: str, *, data: bytes, headers: Mapping[str, str], timeout: Timeouts
    ) -> AbstractAsyncContextManager[UpstreamAnswer]:
        """``async with upstream.post(...) as answer``: the answer once its head arrived; the
        connection is released (or closed) when the block ends."""
        ...

    async def close(self) -> None:
        """Close every connection."""
        ...
