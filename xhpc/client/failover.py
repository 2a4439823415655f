"""A client of several gateways (one per login node): each request goes to the preferred one,
and to the next when that one cannot be reached.

``Rotation`` keeps which gateway is preferred, shared by every request of one client. A
request whose connection to a gateway cannot be opened (refused, or not opened in the connect
timeout: a login node down or cut off) is sent to the next gateway at once: nothing of it
reached the first. A request that fails after its connection opened (the gateway died while
it answered) is not sent again here, since it may have run: the next gateway becomes the
preferred one and the error goes to the caller, whose retry (the openai SDK retries a failed
connection twice by default) goes there.

The transports wrap the HTTP library the openai SDK was built on (``httpx`` or its fork
``httpx2``): they are made by ``transports(httpx_module, ...)``, never imported at the top.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from xhpc.gateway_settings import gateway_origin


class Rotation:
    """The gateways' origins, the preferred one first; a failed one hands the preference on."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("no gateway to send requests to")
        self.origins = [gateway_origin(url.removesuffix("/v1")) for url in urls]
        self.preferred = 0
        self._lock = threading.Lock()

    def order(self) -> list[int]:
        with self._lock:
            first = self.preferred
        n = len(self.origins)
        return [(first + k) % n for k in range(n)]

    def failed(self, index: int) -> None:
        """Gateway ``index`` could not be reached: the next one is preferred from now on."""
        with self._lock:
            if self.preferred == index:
                self.preferred = (index + 1) % len(self.origins)


def _aim(request: Any, origin: tuple[str, str, int]) -> None:
    scheme, host, port = origin
    request.url = request.url.copy_with(scheme=scheme, host=host, port=port)
    shown = f"[{host}]" if ":" in host else host
    request.headers["Host"] = f"{shown}:{port}"


def _unopened(
    rotation: Rotation, index: int, err: Exception, unopened: tuple[type[Exception], ...]
) -> Exception:
    """Gateway ``index`` failed with ``err``: the next one is preferred from now on. ``err`` is
    returned when its connection never opened (the request may go to the next gateway now),
    raised when it did (the request may have run: the caller's retry decides)."""
    rotation.failed(index)
    if isinstance(err, unopened):
        return err
    raise err


def transports(httpx: ModuleType, rotation: Rotation) -> tuple[Any, Any]:
    """A synchronous and an asynchronous transport of ``httpx`` (the SDK's HTTP library) that
    send each request by ``rotation``."""
    unopened = (httpx.ConnectError, httpx.ConnectTimeout)

    class FailoverTransport(httpx.BaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self._inner = httpx.HTTPTransport()

        def handle_request(self, request: Any) -> Any:
            last: Exception | None = None
            for i in rotation.order():
                _aim(request, rotation.origins[i])
                try:
                    return self._inner.handle_request(request)
                except httpx.TransportError as err:
                    last = _unopened(rotation, i, err, unopened)
            raise last  # type: ignore[misc]  # there is always one gateway

        def close(self) -> None:
            self._inner.close()

    class AsyncFailoverTransport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self._inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            last: Exception | None = None
            for i in rotation.order():
                _aim(request, rotation.origins[i])
                try:
                    return await self._inner.handle_async_request(request)
                except httpx.TransportError as err:
                    last = _unopened(rotation, i, err, unopened)
            raise last  # type: ignore[misc]  # there is always one gateway

        async def aclose(self) -> None:
            await self._inner.aclose()

    return FailoverTransport(), AsyncFailoverTransport()


def sdk_httpx(sdk: ModuleType) -> ModuleType:
    """The HTTP library (``httpx`` or ``httpx2``) the openai SDK ``sdk`` was built on."""
    import importlib

    for cls in sdk.DefaultHttpxClient.__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    raise RuntimeError("cannot tell which HTTP library the openai SDK uses")
