"""`xhpc proxy --workers N`: a small supervisor over N worker processes
(``xhpc.proxy.process.worker``).

The supervisor binds the listening socket once and every worker inherits it: the workers share
one accept queue, so a worker that stops accepting leaves the connections waiting in it to the
others (decision 0010 says why not one SO_REUSEPORT socket per worker). It serves nothing itself.

- start: N workers; once each accepts, ``ready_file`` gets the URL;
- a worker that exits unasked (a crash, kill -9) is restarted after a backoff (0.25 s, doubling
  up to 8 s, back to 0.25 s once a worker lived ``STABLE_S``), with a log line; only the
  connections it held are lost;
- SIGHUP, a reload: N fresh workers start (they read the config files again and run the code
  installed now) and, once each accepts with a routing table from the broker, the old ones drain
  (finish their requests within ``proxy.drain_grace_s``, then exit). New workers not ready
  within ``READY_TIMEOUT_S`` are stopped and the old ones keep serving;
- SIGTERM, SIGINT: every worker drains, then ``run_supervisor`` returns.

Workers watch a pipe whose write end only the supervisor holds: if the supervisor dies, they
drain and exit too.

Metrics: the supervisor makes a private directory (``metrics_dir``, 0700) where every worker
publishes its figures (``xhpc.proxy.metrics``), so that a scrape of any worker answers for the
whole gateway. When a worker exits, the supervisor folds its last figures into the sums of the
exited ones (``RetiredMetrics``), so no counter goes back; the directory goes when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xhpc import runner
from xhpc.aio import stop_on_signals
from xhpc.errors import XhpcError
from xhpc.proxy.metrics import RetiredMetrics
from xhpc.proxy.process.server import address_url, write_atomically
from xhpc.proxy.process.tls import proxy_context
from xhpc.proxy.process.worker import BACKLOG, READY_LINE, WorkerCommand, WorkerFds
from xhpc.proxy.tenants.limits import raise_fd_limit
from xhpc.proxy.tenants.shared_holds import HOLDS_DIR, SharedHolds
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 0.25
RESTART_BACKOFF_MAX_S = 8.0
STABLE_S = 10.0  # a worker that lived this long starts its slot's backoff over
READY_TIMEOUT_S = 60.0  # for a worker to accept (with routes, when others serve)
KILL_AFTER_S = 5.0  # past the drain grace period, a worker that has not exited is killed


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on every address of ``host`` (one port for all, even with port 0)."""
    flags = socket.AI_PASSIVE
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=flags)
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(BACKLOG)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise XhpcError(
            f"the proxy cannot listen on {host}:{port}: {err}",
            hint="is another proxy on that port? set proxy.port or XHPC_PROXY_PORT",
        ) from err
    return sockets


def metrics_dir() -> Path:
    """A new directory, the owner's only, for the workers' metric snapshots: in
    ``$XDG_RUNTIME_DIR`` (a per-user tmpfs) when there is one, else in the temp directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="xhpc-proxy-metrics-", dir=base))
    path.chmod(0o700)  # mkdtemp's mode already; said here as the design relies on it
    return path


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


async def _read_ready(fd: int) -> bool:
    """Whether the worker writing to the pipe ``fd`` said it is ready (before exiting)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.readline() == READY_LINE
    finally:
        transport.close()


@dataclass(eq=False)
class _Worker:
    slot: int
    gen: int  # the reload it was started for
    name: str  # its metrics snapshot's name, never reused
    child: runner.Child
    started: float
    ready: asyncio.Task[bool]
    retiring: bool = False

    @property
    def serving(self) -> bool:
        return not self.retiring and _said_ready(self.ready)


def _said_ready(task: asyncio.Task[bool]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None and task.result()


class Supervisor:
    """Starts, restarts, reloads and stops the workers of one proxy (see the module docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        workers: int,
        command: WorkerCommand,
        sockets: Sequence[socket.socket],
        metrics_sockets: Sequence[socket.socket] = (),
    ) -> None:
        self.config = config
        self.count = workers
        self.command = command
        self.sockets = list(sockets)
        self.metrics_sockets = list(metrics_sockets)  # proxy.metrics_listen, if set
        self.gen = 0
        self.live: set[_Worker] = set()
        self.stop = asyncio.Event()
        self._failures: dict[int, int] = {}  # per slot: exits in a row, each soon after start
        self._tasks: set[asyncio.Task[None]] = set()
        self._life_r, self._life_w = os.pipe()
        self.metrics_dir = metrics_dir()
        self.retired = RetiredMetrics(self.metrics_dir)
        self._started = 0  # workers started so far: each one's metrics name

    @property
    def url(self) -> str:
        return address_url(self.sockets[0].getsockname(), tls=self.config.tls is not None)

    def pids(self, *, gen: int | None = None) -> list[int]:
        return sorted(w.child.pid for w in self.live if gen is None or w.gen == gen)

    async def run(self, reload: asyncio.Event, ready_file: Path | None = None) -> None:
        """Serve until ``self.stop`` is set; a reload each time ``reload`` is set."""
        try:
            first = [await self._start(slot, 0, wait_routes=False) for slot in range(self.count)]
            if not await self._all_ready(first):
                if self.stop.is_set():
                    return
                raise XhpcError(
                    "the proxy's workers did not start", hint="their errors are logged above"
                )
            logger.info(
                "proxy listening on %s with %d workers (pids %s)", self.url, self.count, self.pids()
            )
            if ready_file is not None:
                write_atomically(ready_file, self.url + "\n")
            while not self.stop.is_set():
                await _either(self.stop, reload)
                if reload.is_set() and not self.stop.is_set():
                    reload.clear()
                    await self._reload()
        finally:
            await self._stop_all()
            if ready_file is not None:
                ready_file.unlink(missing_ok=True)

    async def _start(self, slot: int, gen: int, *, wait_routes: bool) -> _Worker:
        ready_r, ready_w = os.pipe()
        fds = WorkerFds(
            tuple(s.fileno() for s in self.sockets),
            ready_w,
            self._life_r,
            tuple(s.fileno() for s in self.metrics_sockets),
        )
        self._started += 1
        name = f"w{self._started}"
        argv = self.command.argv(fds, wait_routes=wait_routes, metrics=(self.metrics_dir, name))
        try:
            child = await runner.spawn(argv, env=None, output=None, pass_fds=fds.passed)
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        loop = asyncio.get_running_loop()
        ready = asyncio.create_task(_read_ready(ready_r))
        worker = _Worker(slot, gen, name, child, loop.time(), ready)
        self.live.add(worker)
        self._spawn(self._watch(worker))
        return worker

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _all_ready(self, workers: Sequence[_Worker]) -> bool:
        """Whether every one of ``workers`` accepts within READY_TIMEOUT_S (and no stop)."""
        every: asyncio.Future[Any] = asyncio.gather(*(asyncio.shield(w.ready) for w in workers))
        stopped: asyncio.Future[Any] = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait(
                (every, stopped), timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
            if not every.done():
                every.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await every
        return all(_said_ready(w.ready) for w in workers)

    async def _watch(self, worker: _Worker) -> None:
        """Wait for the worker's exit; restart it unless it was asked to go."""
        code = await worker.child.wait()
        self.live.discard(worker)
        self.retired.absorb(worker.name)  # its counts stay in the gateway's sums
        SharedHolds.forget(self.metrics_dir / HOLDS_DIR, worker.name)  # its holds given back
        what = f"proxy worker {worker.slot} (pid {worker.child.pid}) {_exit_status(code)}"
        if worker.retiring or self.stop.is_set() or worker.gen != self.gen:
            logger.info("%s", what)
            return
        loop = asyncio.get_running_loop()
        fails = (
            1
            if loop.time() - worker.started >= STABLE_S
            else self._failures.get(worker.slot, 0) + 1
        )
        while True:
            self._failures[worker.slot] = fails
            delay = min(RESTART_BACKOFF_S * 2 ** (fails - 1), RESTART_BACKOFF_MAX_S)
            logger.warning("%s; restarting it in %.2fs", what, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            if self.stop.is_set() or worker.gen != self.gen:
                return
            waits = any(w.serving for w in self.live if w.gen == self.gen)
            try:
                new = await self._start(worker.slot, worker.gen, wait_routes=waits)
            except OSError as err:
                what = f"proxy worker {worker.slot} could not start ({err})"
                fails += 1
                continue
            logger.info("proxy worker %d restarted (pid %d)", worker.slot, new.child.pid)
            return

    async def _reload(self) -> None:
        gen = self.gen + 1
        logger.info("reload: starting %d new proxy workers", self.count)
        new = [await self._start(slot, gen, wait_routes=True) for slot in range(self.count)]
        if not await self._all_ready(new):
            if not self.stop.is_set():
                logger.error(
                    "reload abandoned: the new workers did not accept with routes within %.0fs;"
                    " the old ones keep serving",
                    READY_TIMEOUT_S,
                )
            for worker in new:
                self._retire(worker)
            return
        self.gen = gen
        self._failures.clear()
        old = [w for w in self.live if w.gen != gen]
        logger.info(
            "reload: new workers ready (pids %s); the old ones (pids %s) finish their requests",
            self.pids(gen=gen),
            sorted(w.child.pid for w in old),
        )
        for worker in old:
            self._retire(worker)

    def _retire(self, worker: _Worker) -> None:
        """Ask the worker to drain and exit (SIGTERM); kill it if it outlives the grace."""
        if worker.retiring:
            return
        worker.retiring = True

        async def stop() -> None:
            await worker.child.stop(self.config.drain_grace_s + KILL_AFTER_S)

        self._spawn(stop())

    async def _stop_all(self) -> None:
        self.stop.set()
        for sock in (*self.sockets, *self.metrics_sockets):
            sock.close()  # the port closes once the workers stop accepting
        for worker in list(self.live):
            self._retire(worker)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        os.close(self._life_r)
        os.close(self._life_w)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


async def _either(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


async def run_supervisor(
    config: ProxyConfig,
    workers: int,
    command: WorkerCommand,
    *,
    ready_file: Path | None = None,
) -> None:
    """Listen on ``config.host:port`` and serve with ``workers`` worker processes started with
    ``command`` until SIGTERM or SIGINT (then they drain); SIGHUP reloads them. ``ready_file``:
    as ``run_proxy``'s. ``proxy.metrics_listen`` is bound here too, once, like the port.

    The open-files limit is raised to its hard limit here (the workers inherit it and raise
    their own), and the TLS files, if set, are loaded once to refuse a broken pair at start;
    each worker loads them again for its own context."""
    raise_fd_limit()
    proxy_context(config)
    sockets = listen_sockets(config.host, config.port)
    address = config.metrics_address
    try:
        metrics = listen_sockets(*address) if address is not None else []
    except XhpcError:
        for sock in sockets:
            sock.close()
        raise
    supervisor = Supervisor(config, workers, command, sockets, metrics)
    reload = asyncio.Event()
    with stop_on_signals(supervisor.stop), stop_on_signals(reload, (signal.SIGHUP,)):
        await supervisor.run(reload, ready_file)
