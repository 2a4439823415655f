"""Where the proxy's routing table comes from: the broker's control API on its UNIX socket.

The proxy polls ``POST /v1/proxy/sync`` in the background: it sends the version of the table it
holds and its in-flight requests per replica (so the broker knows when a draining replica has no
traffic left) and gets the current table back. When the broker is down or answers nonsense, the
proxy keeps serving from the last table it received (a broker crash must never drop traffic) and
logs one warning per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType

import aiohttp
import pydantic
from aiohttp import web

from xhpc.errors import BrokerError, BrokerUnavailableError
from xhpc.models import ProxyLoad, RoutingTable
from xhpc.proxy.app import ROUTER_KEY
from xhpc.proxy.routing import Router

logger = logging.getLogger(__name__)

SYNC_URL = "http://broker/v1/proxy/sync"


class BrokerRouteSource:
    """Polls the broker for the routing table every ``interval_s`` seconds.

    Use it as an async context manager around ``fetch``/``poll_once``, run ``run(router)`` as a
    task, or ``install(app)`` to poll for the lifetime of a proxy app made by ``make_app``.
    """

    def __init__(self, socket_path: Path, interval_s: float, *, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = 0  # consecutive failed refreshes; 0 while the broker answers
        self.proxy_id = f"{socket.gethostname()}:{os.getpid()}"
        self.refreshes = 0  # successful refreshes so far
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BrokerRouteSource:
        connector = aiohttp.UnixConnector(path=str(self.socket_path), force_close=True)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def fetch(self, load: ProxyLoad | None = None) -> RoutingTable:
        """The broker's current table; raises BrokerUnavailableError or BrokerError."""
        if self._session is None:
            raise RuntimeError("use `async with BrokerRouteSource(...)` before fetching")
        load = load or ProxyLoad(proxy_id=self.proxy_id, table_version=0)
        try:
            async with self._session.post(
                SYNC_URL,
                data=load.model_dump_json(),
                headers={"Content-Type": "application/json"},
            ) as resp:
                status = resp.status
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise BrokerUnavailableError(
                f"cannot reach the broker at {self.socket_path}: {type(err).__name__}: {err}",
                hint="is `xhpc broker` running?",
            ) from err
        if status != 200:
            raise BrokerError(f"broker answered {status} to POST /v1/proxy/sync", status=status)
        try:
            return RoutingTable.model_validate_json(data)
        except pydantic.ValidationError as err:
            raise BrokerError(
                f"broker sent an invalid routing table ({err.error_count()} errors)",
                status=status,
                code="invalid_routes",
            ) from err

    async def poll_once(self, router: Router) -> bool:
        """Refresh ``router`` from the broker; on failure keep its table. True on success."""
        load = ProxyLoad(
            proxy_id=self.proxy_id,
            table_version=router.table.version,
            outstanding=router.outstanding_all(),
            unreachable=router.take_unreachable(),
        )
        try:
            table = await self.fetch(load)
        except (BrokerUnavailableError, BrokerError) as err:
            for rid in load.unreachable:
                router.unreachable_again(rid)  # told at the next sync that goes through
            self.failures += 1
            if self.failures == 1:
                logger.warning(
                    "routing table refresh failed; keeping the last known table (version %d): %s",
                    router.table.version,
                    err.one_line(),
                )
            return False
        if self.failures:
            logger.info("broker answers again after %d failed refreshes", self.failures)
        self.failures = 0
        self.refreshes += 1
        router.update(table)
        return True

    async def _poll_forever(self, router: Router) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once(router)
            except Exception:
                logger.exception("unexpected error refreshing the routing table")

    async def run(self, router: Router) -> None:
        """Poll until cancelled."""
        async with self:
            await self.poll_once(router)
            await self._poll_forever(router)

    def install(self, app: web.Application) -> None:
        """Poll for the lifetime of ``app``; the first refresh happens before it serves."""
        app.cleanup_ctx.append(self._lifespan)

    async def _lifespan(self, app: web.Application) -> AsyncIterator[None]:
        router = app[ROUTER_KEY]
        async with self:
            await self.poll_once(router)
            task = asyncio.create_task(self._poll_forever(router), name="xhpc-proxy-routes")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
