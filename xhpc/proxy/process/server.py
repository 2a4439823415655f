"""Run the proxy process: bind, serve until cancelled or signalled, shut down cleanly.

``run_proxy`` is `xhpc proxy --workers 1`: one process that binds its own socket. With more
workers, ``xhpc.proxy.process.supervisor`` binds the socket and ``xhpc.proxy.process.worker`` runs
the same app (``build_app``) in each worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import resource
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from xhpc.aio import stop_on_signals
from xhpc.proxy.app import make_app, make_metrics_app
from xhpc.proxy.batch_api.batches import BatchFront
from xhpc.proxy.batch_api.files import FileLimits, FileStore
from xhpc.proxy.broker_metrics import BrokerSections
from xhpc.proxy.process.listener import GatewayRunner
from xhpc.proxy.process.tls import proxy_context
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.source import BrokerRouteSource
from xhpc.proxy.tenants.keys import GrantSource, KeyBook
from xhpc.proxy.tenants.limits import ClientLimits, raise_fd_limit
from xhpc.settings import XhpcConfig

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
# Allocations (less deallocations) between two young-generation collections; CPython's default
# is 700, which requests in flight cross all the time (see ``serving_interpreter``).
GC_GEN0_THRESHOLD = 20_000
# How long a thread holds the GIL before another waiting for it gets it (CPython's default: 5
# ms). An upload's lines are checked in a thread: at 5 ms, every request of the event loop on
# the same worker waited up to 5 ms at each of its turns for the GIL, which tripled the chat
# p99 of the other tenants while one uploaded (bench/hostile.py).
SWITCH_INTERVAL_S = 0.0005


def address_url(sockname: Any, *, tls: bool = False) -> str:
    """The URL a client on this host can use to reach a socket bound to ``sockname``."""
    host, port = sockname[:2]
    addr = ipaddress.ip_address(host)
    if addr.is_unspecified:
        addr = ipaddress.ip_address("::1" if addr.version == 6 else "127.0.0.1")
    shown = f"[{addr}]" if addr.version == 6 else str(addr)
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def bound_url(runner: web.BaseRunner, *, tls: bool = False) -> str:
    """The URL a client on this host can use, from the socket the runner actually bound."""
    if not runner.addresses:
        raise RuntimeError("the proxy is not listening on any socket")
    return address_url(runner.addresses[0], tls=tls)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


@contextlib.contextmanager
def serving_interpreter() -> Iterator[None]:
    """The interpreter set for serving, until the block exits: its garbage collector, and its
    thread switch interval (``SWITCH_INTERVAL_S``).

    The objects alive after start-up (modules, the app; ~100k) are frozen out of collection,
    and the young generation is collected after 20,000 net allocations instead of 700. With
    CPython's defaults the collector took ~30 us per request at c=64 (a full collection, ~55
    ms, every ~2,500 requests, and the requests in flight promoted at every young one); the
    objects a request makes are freed by their reference counts, so collections are rare now.
    """
    gc.collect()
    gc.freeze()
    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(GC_GEN0_THRESHOLD, *threshold[1:])
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        gc.set_threshold(*threshold)
        gc.unfreeze()


@dataclass(frozen=True)
class ServedApp:
    """The gateway app of one proxy process and what keeps its state fresh from the broker."""

    app: web.Application
    routes: BrokerRouteSource
    grants: GrantSource | None  # None when keys are not required

    @property
    def synced(self) -> bool:
        """It holds a routing table (and the key grants) the broker sent."""
        return self.routes.refreshes > 0 and (self.grants is None or self.grants.syncs > 0)


def build_app(config: XhpcConfig, socket_path: Path) -> ServedApp:
    """The gateway app, polling the broker's control socket ``socket_path`` while it runs (a
    lab gateway: each socket in ``[proxy] brokers`` instead)."""
    router = Router(config=config.proxy)
    keys = KeyBook() if config.proxy.auth == "keys" else None
    brokers = config.proxy.brokers or (socket_path,)
    files = FileStore(config.resolved_state_dir / "files", FileLimits.of(config.proxy))
    # A lab gateway: its first broker's.
    batches = BatchFront(files, brokers[0], keys, router, catalog=tuple(config.models))
    app = make_app(router, keys=keys, extra_routes=batches.routes, brokers=BrokerSections(brokers))
    files.install(app)  # expired files swept
    routes = BrokerRouteSource(brokers, config.proxy.refresh_interval_s)
    routes.install(app)
    grants = None
    if keys is not None:
        grants = GrantSource(brokers[0], keys, config.proxy.refresh_interval_s, routes)
        grants.install(app)
    return ServedApp(app, routes, grants)


def app_runner(
    app: web.Application, config: XhpcConfig, shutdown_timeout_s: float
) -> GatewayRunner:
    """A runner for ``app`` that holds its clients to ``[proxy]``'s limits."""
    # No per-request access log: it costs a quarter of the proxy's throughput; /metrics counts
    # requests instead (`proxy.access_log = true` turns it on).
    return GatewayRunner(
        app,
        client_limits(config),
        access_log=config.proxy.access_log,
        shutdown_timeout_s=shutdown_timeout_s,
    )


def client_limits(config: XhpcConfig) -> ClientLimits:
    """``[proxy]``'s limits on clients, the connection cap lowered to what this process's
    descriptors allow."""
    fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ClientLimits.of(config.proxy).within_fds(fds)


async def metrics_runner(
    app: web.Application, config: XhpcConfig, sockets: Sequence[socket.socket] = ()
) -> web.BaseRunner | None:
    """``/metrics`` of ``app`` with no key on ``proxy.metrics_listen``, served until the
    runner is cleaned up: on ``sockets`` (a worker's, which the supervisor bound), else on a
    socket bound here. None when no metrics listener is configured (or no socket is given)."""
    address = config.proxy.metrics_address
    if address is None and not sockets:
        return None
    runner = GatewayRunner(make_metrics_app(app), client_limits(config))
    await runner.setup()
    try:
        sites: list[web.BaseSite] = [web.SockSite(runner, sock) for sock in sockets]
        if not sites and address is not None:
            sites.append(web.TCPSite(runner, *address))
        for site in sites:
            await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    logger.info("proxy metrics (no key) on %s/metrics", bound_url(runner))
    return runner


async def run_proxy(
    config: XhpcConfig, socket_path: Path, *, ready_file: Path | None = None
) -> None:
    """Serve the OpenAI gateway on ``config.proxy.host:port`` until cancelled, SIGTERM or SIGINT.

    Routes come from the broker's control socket ``socket_path``. With ``ready_file`` the bound
    URL (useful with port 0) is written there once the proxy listens, and removed on exit.
    """
    raise_fd_limit()
    tls = proxy_context(config.proxy)
    app = build_app(config, socket_path).app
    runner = app_runner(app, config, SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    stop = asyncio.Event()
    metrics: web.BaseRunner | None = None
    try:
        with serving_interpreter():
            site = web.TCPSite(runner, config.proxy.host, config.proxy.port, ssl_context=tls)
            await site.start()
            metrics = await metrics_runner(app, config)
            url = bound_url(runner, tls=tls is not None)
            shown = ", ".join(str(p) for p in config.proxy.brokers or (socket_path,))
            logger.info("proxy listening on %s (routes from %s)", url, shown)
            if ready_file is not None:
                write_atomically(ready_file, url + "\n")
            with stop_on_signals(stop):
                await stop.wait()
            logger.info("proxy shutting down")
    finally:
        if metrics is not None:
            await metrics.cleanup()
        await runner.cleanup()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
