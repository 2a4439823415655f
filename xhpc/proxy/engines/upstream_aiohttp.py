"""aiohttp's client as an ``Upstream`` (``xhpc.proxy.engines.upstream_api``): a thin adapter.

The proxy's own client (``xhpc.proxy.engines.upstream``) is its default; this one serves what that
one does not (URLs other than ``http://``: the own client hands them here) and runs the gateway on
aiohttp's client when an app is made so (``make_app(upstream_factory=aiohttp_upstream)``, the
tests that check both transports behave alike). It adds nothing to aiohttp but the mapping of
its exceptions onto the proxy's error tree, at the three places they surface (the answer's
head, ``read``, ``chunks``):

    aiohttp.ConnectionTimeoutError                    UpstreamConnectTimeout
    aiohttp.ClientConnectorError (refused, DNS, TLS)  UpstreamConnectError
    any other TimeoutError (total, sock_read)         UpstreamReadTimeout
    aiohttp.ClientResponseError (a head it refused)   UpstreamProtocolError
    any other aiohttp.ClientError (disconnected,      UpstreamDropped
      payload cut short, reset)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import aiohttp

from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDropped,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReadTimeout,
)

FAILURES = (aiohttp.ClientError, TimeoutError)  # what aiohttp's client raises when it fails


def upstream_error(err: aiohttp.ClientError | TimeoutError) -> UpstreamError:
    """The proxy's error for one of aiohttp's (its message names aiohttp's)."""
    message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if isinstance(err, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectTimeout(message)
    if isinstance(err, aiohttp.ClientConnectorError):
        return UpstreamConnectError(message)
    if isinstance(err, TimeoutError):
        return UpstreamReadTimeout(message)
    if isinstance(err, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"the engine's answer broke HTTP/1.1: {message}")
    return UpstreamDropped(message)


class _Answer:
    """An ``UpstreamAnswer`` over an ``aiohttp.ClientResponse``."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except FAILURES as err:
            raise upstream_error(err) from err

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except FAILURES as err:
            raise upstream_error(err) from err

    def close(self) -> None:
        self._response.close()


class _Post:
    """``async with upstream.post(...) as answer`` over aiohttp's request context manager."""

    __slots__ = ("_request",)

    def __init__(self, request: AbstractAsyncContextManager[aiohttp.ClientResponse]) -> None:
        self._request = request

    async def __aenter__(self) -> _Answer:
        try:
            return _Answer(await self._request.__aenter__())
        except FAILURES as err:
            raise upstream_error(err) from err

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._request.__aexit__(exc_type, exc, tb)
        except FAILURES as err:
            raise upstream_error(err) from err


class AiohttpUpstream:
    """An ``Upstream`` over an ``aiohttp.ClientSession`` (closed with it)."""

    __slots__ = ("_timeouts", "session")

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    def post(
        self, url: str, *, data: bytes, headers: Mapping[str, str], timeout: Timeouts
    ) -> _Post:
        limits = self._timeouts.get(timeout)
        if limits is None:
            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            limits = self._timeouts[timeout] = aiohttp.ClientTimeout(
                total=timeout.total, connect=timeout.connect, sock_read=timeout.read
            )
        return _Post(self.session.post(url, data=data, headers=headers, timeout=limits))

    async def close(self) -> None:
        await self.session.close()


def aiohttp_upstream() -> AiohttpUpstream:
    """aiohttp's client for all engines: no connection cap, no proxy from the environment, no
    cookie jar (an engine's cookies must not follow other callers' requests)."""
    return AiohttpUpstream(
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
    )
