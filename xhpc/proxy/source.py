"""Where the proxy's routing table comes from: the broker's control API on its UNIX socket.

The proxy long-polls ``POST /v1/proxy/sync`` in the background: it sends the version of the table
it holds and its in-flight requests per replica (so the broker knows when a draining replica has
no traffic left); the broker answers the moment its table differs from that version, or after
the refresh interval with the table as it is. When the broker is down or answers nonsense, the
proxy keeps serving from the last table it received (a broker crash must never drop traffic) and
logs one warning per outage. A lab gateway reads several brokers, one per member (``[proxy]
brokers``; ``xhpc.proxy.lab`` merges their tables), each told only of its own replicas. Each
table is read with ``xhpc.proxy.broker_call``: bounded (``max_answer_bytes``), and with the uid
of the process that sent it, from the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType

import pydantic
from aiohttp import web

from xhpc.clock import monotonic
from xhpc.errors import BrokerError, BrokerUnavailableError, XhpcError
from xhpc.models import ProxyLoad, RoutingTable
from xhpc.peers import user_name
from xhpc.proxy import broker_call
from xhpc.proxy.app_keys import ROUTER_KEY
from xhpc.proxy.lab import BrokerLink, LabTable, merge
from xhpc.proxy.routes.routing import Router
from xhpc.wire import read_json

logger = logging.getLogger(__name__)

SYNC_PATH = "/v1/proxy/sync"
MIN_SYNC_GAP_S = 0.02


# A table of a lower lease token than the link's last is a former leader's (frozen, resumed):
# ignored while the higher one's broker still answers; after this long without a word from it,
# the lower one is taken (a state restored from a backup leads with an older token).
EPOCH_GRACE_S = 60.0


def stale_epoch(link: BrokerLink, epoch: int, now: float) -> bool:
    """Whether a table of ``epoch`` from ``link`` is to be ignored; else the link's epoch is
    brought up to it."""
    if epoch < link.epoch and now - link.epoch_at < EPOCH_GRACE_S:
        return True
    link.epoch, link.epoch_at = epoch, now
    return False


class BrokerRouteSource:
    """Long-polls the broker (or, for a lab gateway, each broker: ``xhpc.proxy.lab``) for the
    routing table, each answer held up to ``interval_s`` seconds until the table changes.

    Use it as an async context manager around ``fetch``/``poll_once``, run ``run(router)`` as a
    task, or ``install(app)`` to poll for the lifetime of a proxy app made by ``make_app``.
    """

    def __init__(
        self,
        socket_paths: Path | Sequence[Path],
        interval_s: float,
        *,
        timeout_s: float = 5.0,
        max_answer_bytes: int = broker_call.MAX_ANSWER,
    ) -> None:
        paths = [socket_paths] if isinstance(socket_paths, Path) else list(socket_paths)
        if not paths:
            raise ValueError("no broker to read routes from")
        self.links = [BrokerLink(path) for path in paths]
        self.socket_path = paths[0]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes  # a larger answer is the broker's failure
        self.failures = 0  # consecutive refreshes that missed a broker; 0 while all answer
        self.proxy_id = f"{socket.gethostname()}:{os.getpid()}"
        self.refreshes = 0  # refreshes that got the first broker's table so far
        self.lab = LabTable(RoutingTable())
        self._open = False

    async def __aenter__(self) -> BrokerRouteSource:
        self._open = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False

    async def fetch(self, load: ProxyLoad | None = None, index: int = 0) -> RoutingTable:
        """Broker ``index``'s current table; raises BrokerUnavailableError or BrokerError."""
        table, _ = await self._fetch(
            index, load or ProxyLoad(proxy_id=self.proxy_id, table_version=0)
        )
        return table

    async def _fetch(self, index: int, load: ProxyLoad) -> tuple[RoutingTable, int | None]:
        """A broker's table, and the uid of the process that sent it: a lab gateway's brokers'
        owners come from the kernel (the peer credentials of the connection the table came
        on), never from what they say."""
        if not self._open:
            raise RuntimeError("use `async with BrokerRouteSource(...)` before fetching")
        path = self.links[index].socket_path
        answer = await broker_call.call(
            path,
            "POST",
            SYNC_PATH,
            load.model_dump_json().encode(),
            timeout_s=self.timeout_s + load.wait_s,
            max_bytes=self.max_answer_bytes,
        )
        status = answer.status
        if status != 200:
            raise BrokerError(f"broker answered {status} to POST {SYNC_PATH}", status=status)
        if answer.uid is None and index > 0:
            raise BrokerError(f"cannot tell who runs the broker at {path}", status=status)
        try:
            table = read_json(RoutingTable, answer.body)
        except pydantic.ValidationError as err:
            raise BrokerError(
                f"broker sent an invalid routing table ({err.error_count()} errors)",
                status=status,
                code="invalid_routes",
            ) from err
        return table, answer.uid

    async def poll_once(self, router: Router, wait_s: float = 0.0) -> bool:
        """Refresh ``router`` from the brokers; on a broker's failure keep what it sent last.
        True when every broker answered.

        With ``wait_s`` each broker holds its answer until its table changes (then the router
        is updated at once) or ``wait_s`` passes. The brokers are asked together; each answer
        is applied as it comes."""
        found = router.take_unreachable()
        outstanding = router.outstanding_all()
        begun, unserved, held = router.demand()
        loads = []
        for i, link in enumerate(self.links):
            # A replica found unreachable is news for the broker that serves its model only.
            mine = tuple(r for r in found if self._broker_of_replica(r, router) in (None, i))
            loads.append(
                ProxyLoad(
                    proxy_id=self.proxy_id,
                    table_version=link.table.version if link.table is not None else 0,
                    outstanding=outstanding,
                    unreachable=mine,
                    begun=begun,
                    unserved=unserved,
                    held=held,
                    wait_s=wait_s,
                )
            )

        async def ask(i: int) -> tuple[int, tuple[RoutingTable, int | None] | XhpcError]:
            try:
                return i, await self._fetch(i, loads[i])
            except (BrokerUnavailableError, BrokerError) as err:
                return i, err

        answered = 0
        for next_answer in asyncio.as_completed([ask(i) for i in range(len(self.links))]):
            i, result = await next_answer
            link = self.links[i]
            if isinstance(result, XhpcError):
                for rid in loads[i].unreachable:
                    router.unreachable_again(rid)  # told at the next sync that goes through
                link.failures += 1
                if link.failures == 1:
                    logger.warning(
                        "routing table refresh failed; keeping the last known table (version "
                        "%d): %s",
                        link.table.version if link.table is not None else 0,
                        result.one_line(),
                    )
                continue
            table, uid = result
            if stale_epoch(link, table.epoch, monotonic()):
                logger.warning(
                    "a routing table of lease token %d ignored: the broker at %s leads with %d",
                    table.epoch, link.socket_path, link.epoch,
                )  # fmt: skip
                continue
            link.table, link.uid = table, uid
            link.user = None if link.uid is None else user_name(link.uid)
            if link.failures:
                logger.info("broker answers again after %d failed refreshes", link.failures)
            link.failures = 0
            answered += 1
            self._apply(router)
        if self.links[0].failures == 0:
            self.refreshes += 1
        if answered < len(self.links):
            self.failures += 1
            return False
        self.failures = 0
        return True

    def _apply(self, router: Router) -> None:
        """Route by the tables the brokers sent last (a lab gateway merges them)."""
        lab = merge(self.links)
        new = {(c.model, c.kept, c.ignored) for c in lab.conflicts} - {
            (c.model, c.kept, c.ignored) for c in self.lab.conflicts
        }
        for model, kept, ignored in sorted(new):
            logger.warning(
                "model %r is served by the broker at %s; the one at %s lists it too and is "
                "not routed",
                model,
                self.links[kept].socket_path,
                self.links[ignored].socket_path,
            )
        self.lab = lab
        router.update(lab.table)

    def _broker_of_replica(self, replica_id: str, router: Router) -> int | None:
        if len(self.links) == 1:
            return 0
        route = router.route(replica_id)
        return None if route is None else self.lab.broker_of.get(route.model)

    async def _poll_forever(self, router: Router) -> None:
        """Sync with the brokers again and again, each holding its answer for up to
        ``interval_s`` until its table changes: a new route is pushed at once, and the load
        (in-flight requests, unreachable replicas) reaches the brokers at least that often."""
        while True:
            started = monotonic()
            before = self._versions()
            try:
                await self.poll_once(router, wait_s=self.interval_s)
            except Exception:
                logger.exception("unexpected error refreshing the routing table")
            # A new table: ask again at once (the next answer is held). Otherwise wait out the
            # interval: a broker that is down, or one that does not hold answers, is asked once
            # per interval, not in a loop.
            gap = MIN_SYNC_GAP_S if self._versions() != before else self.interval_s
            await asyncio.sleep(max(0.0, gap - (monotonic() - started)))

    def _versions(self) -> list[int | None]:
        return [None if link.table is None else link.table.version for link in self.links]

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
