"""One worker of `xhpc proxy --workers N`: the gateway app on the listening socket it inherits
from the supervisor (``xhpc.proxy.process.supervisor``), drained without dropping requests on
SIGTERM.

Start: the app starts (its first route fetch). With ``wait_routes`` (a worker started while
others serve: a restart, a reload) it joins the accept queue only once the broker has sent it a
routing table (and the key grants), so it never answers from an empty table. Then it writes
``ready`` to its ready pipe.

Drain (SIGTERM or SIGINT, or the supervisor gone: the life pipe reads end-of-file):

1. stop accepting: close this process's copy of the listening socket. The socket stays open in
   the supervisor and the other workers, so the connections waiting in its accept queue go to
   them; none is reset (one SO_REUSEPORT socket per worker would reset them: decision 0010);
2. every answer from now on says ``Connection: close``: a keep-alive client learns from its next
   answer to open a new connection (to another worker) instead of finding this one closed;
3. a connection with no stream in flight that stayed so for ``IDLE_CLOSE_S`` is closed (after
   the answer it may be waiting for, which says ``Connection: close``); a stream that began
   before the drain keeps its connection until it ends, and that connection is then left idle
   as long, in case its client sends one more request on it;
4. when no connection is left, or after ``drain_grace_s``, the app stops; what is still in
   flight then is cut.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import hdrs, web

from xhpc.aio import stop_on_signals
from xhpc.config import load_config
from xhpc.errors import ConfigError
from xhpc.proxy.app_keys import METRICS_KEY, ROUTER_KEY
from xhpc.proxy.process.listener import GatewayProtocol
from xhpc.proxy.process.server import (
    ServedApp,
    app_runner,
    bound_url,
    build_app,
    metrics_runner,
    serving_interpreter,
)
from xhpc.proxy.process.tls import proxy_context
from xhpc.proxy.tenants.limits import raise_fd_limit
from xhpc.proxy.tenants.rates import SharedBuckets
from xhpc.proxy.tenants.shared_holds import HOLDS_DIR, SharedHolds
from xhpc.settings import XhpcConfig

logger = logging.getLogger(__name__)

BACKLOG = 1024  # the shared socket's accept queue (the supervisor's listen() says the same)
IDLE_CLOSE_S = 1.0  # while draining, a connection idle this long is closed
POLL_S = 0.05
SHUTDOWN_TIMEOUT_S = 1.0  # after the drain: in-flight handlers get this long, then are cancelled
READY_LINE = b"ready\n"


@dataclass(frozen=True)
class WorkerFds:
    """The descriptors a worker inherits: the listening socket(s), the write end of its ready
    pipe, the read end of the supervisor's life pipe, and the sockets of
    ``proxy.metrics_listen`` if it is set (``/metrics`` with no key)."""

    listen: tuple[int, ...]
    ready: int
    life: int
    metrics: tuple[int, ...] = ()

    @property
    def passed(self) -> tuple[int, ...]:
        return (*self.listen, self.ready, self.life, *self.metrics)


@dataclass(frozen=True)
class WorkerCommand:
    """How the supervisor starts a worker: ``python -m xhpc.proxy`` with the supervisor's config
    sources. The worker loads the config itself, so a reload reads the files again (and runs
    the code installed now)."""

    broker_socket: Path
    site: Path | None = None
    debug: bool = False

    def argv(
        self, fds: WorkerFds, *, wait_routes: bool, metrics: tuple[Path, str] | None = None
    ) -> list[str]:
        """``metrics``: the directory where the workers publish their metrics, and this
        worker's name there."""
        out = [sys.executable, "-m", "xhpc.proxy", "--broker-socket", str(self.broker_socket)]
        for fd in fds.listen:
            out += ["--listen-fd", str(fd)]
        out += ["--ready-fd", str(fds.ready), "--life-fd", str(fds.life)]
        for fd in fds.metrics:
            out += ["--metrics-listen-fd", str(fd)]
        if metrics is not None:
            out += ["--metrics-dir", str(metrics[0]), "--metrics-name", metrics[1]]
        if self.site is not None:
            out += ["--site", str(self.site.resolve())]
        if self.debug:
            out.append("--debug")
        if wait_routes:
            out.append("--wait-routes")
        return out


def main(args: Sequence[str] | None = None) -> None:
    """The worker process's entry (``python -m xhpc.proxy``; ``WorkerCommand`` builds the line)."""
    parser = argparse.ArgumentParser(
        prog="python -m xhpc.proxy",
        description="One worker of `xhpc proxy --workers N`; its supervisor starts it.",
    )
    parser.add_argument("--broker-socket", type=Path, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True)
    parser.add_argument("--metrics-listen-fd", type=int, action="append", default=[])
    parser.add_argument("--site", type=Path, default=None)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--wait-routes", action="store_true")
    parser.add_argument("--metrics-dir", type=Path, default=None)
    parser.add_argument("--metrics-name", default=None)
    ns = parser.parse_args(args)
    logging.basicConfig(
        level=logging.DEBUG if ns.debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        config, _ = load_config(ns.site)
    except ConfigError as err:
        print(f"error: {err.one_line()}", file=sys.stderr)
        sys.exit(err.exit_code)
    fds = WorkerFds(tuple(ns.listen_fd), ns.ready_fd, ns.life_fd, tuple(ns.metrics_listen_fd))
    metrics = None
    if ns.metrics_dir is not None:
        metrics = (ns.metrics_dir, ns.metrics_name or f"pid{os.getpid()}")
    try:
        asyncio.run(
            run_worker(config, ns.broker_socket, fds, wait_routes=ns.wait_routes, metrics=metrics)
        )
    except ConfigError as err:  # e.g. its TLS files: the supervisor logs it, the reload fails
        print(f"error: {err.one_line()}", file=sys.stderr)
        sys.exit(err.exit_code)


class Drain:
    """A worker's graceful stop: ``Connection: close`` on every answer once draining, and which
    connections have a stream in flight (a stream holds its connection until it ends)."""

    def __init__(self) -> None:
        self.draining = False
        self._streams: dict[web.RequestHandler, asyncio.Task[object]] = {}

    def install(self, app: web.Application) -> None:
        app.on_response_prepare.append(self._on_prepare)

    async def _on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.draining:
            # aiohttp has chosen the headers by now; the close must be said, not just done
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"
        if type(response) is web.StreamResponse:  # a stream; a body is written at once
            task = asyncio.current_task()
            if task is not None:
                conn = request.protocol
                self._streams[conn] = task
                task.add_done_callback(functools.partial(self._ended, conn))

    def _ended(self, conn: web.RequestHandler, task: asyncio.Task[object]) -> None:
        if self._streams.get(conn) is task:
            del self._streams[conn]

    async def run(
        self, runner: web.BaseRunner, sites: Sequence[web.BaseSite], grace_s: float
    ) -> int:
        """Drain (steps 1-3 above) until no connection is left or ``grace_s`` has passed;
        returns the connections still open then."""
        self.draining = True
        for site in sites:
            await site.stop()
        server = runner.server
        if server is None:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        idle_since: dict[web.RequestHandler, float] = {}
        while server.connections and loop.time() < deadline:
            now = loop.time()
            for conn in server.connections:
                if conn in self._streams:
                    idle_since.pop(conn, None)
                elif now - idle_since.setdefault(conn, now) >= IDLE_CLOSE_S:
                    _close(conn)
            await asyncio.sleep(POLL_S)
        return len(server.connections)


def _close(conn: web.RequestHandler) -> None:
    """Close a connection with no stream in flight: now if it waits for a request, else after
    the answer in progress. (aiohttp's ``close()`` of a connection waiting for its next request
    ends its handler but leaves the socket open: the drain would wait out its grace for it.)"""
    if isinstance(conn, GatewayProtocol) and conn.waiting:
        conn.force_close()
    else:
        conn.close()


@contextlib.contextmanager
def _stop_at_eof(fd: int, stop: asyncio.Event) -> Iterator[None]:
    """Within the block, ``stop`` is set when ``fd`` (a pipe nobody writes to) reads
    end-of-file: the process that held its write end is gone."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(fd)
            logger.warning("the proxy supervisor is gone; this worker stops")
            stop.set()

    loop.add_reader(fd, readable)
    try:
        yield
    finally:
        loop.remove_reader(fd)


async def _synced(served: ServedApp, stop: asyncio.Event) -> bool:
    """Wait until the app holds what the broker sends; False if told to stop first."""
    while not served.synced:
        if stop.is_set():
            return False
        await asyncio.sleep(POLL_S)
    return True


def _signal_ready(fd: int) -> None:
    try:
        os.write(fd, READY_LINE)
    finally:
        os.close(fd)


async def run_worker(
    config: XhpcConfig,
    socket_path: Path,
    fds: WorkerFds,
    *,
    wait_routes: bool = False,
    metrics: tuple[Path, str] | None = None,
) -> None:
    """Serve the gateway on the inherited sockets ``fds.listen`` until SIGTERM, SIGINT or the
    supervisor's end, then drain (see the module docstring). ``metrics``: the directory where
    the workers publish their metrics and this worker's name there (``/metrics`` then answers
    for every worker: ``xhpc.proxy.metrics``)."""
    raise_fd_limit()
    served = build_app(config, socket_path)
    if metrics is None:
        await _run(served, config, fds, wait_routes)
        return
    counted = served.app[METRICS_KEY]
    router = served.app[ROUTER_KEY]
    counted.share(*metrics)
    if served.grants is not None:
        # Rate limits hold for the gateway: the workers share each key's bucket.
        served.grants.book.shared = SharedBuckets(metrics[0] / "rates")
        # So do concurrency caps and quota reservations: the workers count each other's holds.
        served.grants.book.holds.shared = SharedHolds(metrics[0] / HOLDS_DIR, metrics[1])
    publisher = asyncio.create_task(counted.publish_every(router))
    try:
        await _run(served, config, fds, wait_routes)
    finally:
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        counted.publish(router)  # the last figures, for the supervisor to keep


async def _run(served: ServedApp, config: XhpcConfig, fds: WorkerFds, wait_routes: bool) -> None:
    drain = Drain()
    drain.install(served.app)
    tls = proxy_context(config.proxy)  # this worker's own, from the files as they are now
    runner = app_runner(served.app, config, SHUTDOWN_TIMEOUT_S)
    stop = asyncio.Event()
    ignored = (signal.SIGHUP,)  # reloads are the supervisor's business
    with (
        stop_on_signals(stop),
        stop_on_signals(asyncio.Event(), ignored),
        _stop_at_eof(fds.life, stop),
    ):
        await runner.setup()
        metrics = None
        try:
            if fds.metrics:  # bound by the supervisor: this worker never binds one itself
                sockets = [socket.socket(fileno=fd) for fd in fds.metrics]
                metrics = await metrics_runner(served.app, config, sockets)
            with serving_interpreter():
                if wait_routes and not await _synced(served, stop):
                    os.close(fds.ready)
                    return
                await _serve(runner, drain, fds, stop, config.proxy.drain_grace_s, tls)
        finally:
            if metrics is not None:
                await metrics.cleanup()
            await runner.cleanup()


async def _serve(
    runner: web.BaseRunner,
    drain: Drain,
    fds: WorkerFds,
    stop: asyncio.Event,
    grace_s: float,
    tls: ssl.SSLContext | None = None,
) -> None:
    sites = [
        web.SockSite(runner, socket.socket(fileno=fd), backlog=BACKLOG, ssl_context=tls)
        for fd in fds.listen
    ]
    for site in sites:
        await site.start()
    pid = os.getpid()
    logger.info("proxy worker %d serving on %s", pid, bound_url(runner, tls=tls is not None))
    _signal_ready(fds.ready)
    await stop.wait()
    loop = asyncio.get_running_loop()
    started = loop.time()
    left = await drain.run(runner, sites, grace_s)
    cut = f"; {left} connection(s) cut at the grace period" if left else ""
    logger.info("proxy worker %d drained in %.1fs%s", pid, loop.time() - started, cut)
