"""`xhpc broker`: runs the control API, the agent API and the reconcile loop."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import json
import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from xhpc.broker.api import MAX_CONTROL_BODY, agent_app, control_app
from xhpc.broker.relay import SECRET_NAME as RELAY_SECRET
from xhpc.broker.relay import RelayKey, relay_app
from xhpc.broker.service import BrokerService
from xhpc.broker.watch.probes import ProbeBook, ensure_probe_token, ensure_token_file
from xhpc.clock import utcnow
from xhpc.errors import FencedError, XhpcError
from xhpc.paths import (
    broker_file_path,
    broker_file_path_in,
    control_socket_path,
    control_token_path_in,
    fits_socket,
    host_socket_path,
)
from xhpc.peers import listening
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import CliSlurmClient
from xhpc.store import Store
from xhpc.store.lease import Lease, LeaseState, LeaseUnreadable
from xhpc.store.secrets import shared_secret

log = logging.getLogger(__name__)


def _advertise_host(config: XhpcConfig) -> str:
    if config.broker.advertise_host:
        return config.broker.advertise_host
    if config.broker.agent_bind not in ("0.0.0.0", ""):
        return config.broker.agent_bind
    return socket.getfqdn()


async def reconcile_loop(service: BrokerService, interval_s: float) -> None:
    while True:
        try:
            await service.reconcile_once()
        except XhpcError as err:
            log.warning("reconcile failed: %s", err.one_line())
        except Exception:
            log.exception("reconcile crashed; continuing")
        await asyncio.sleep(interval_s)


def hold_state_lock(state_dir: Path) -> int:
    """One broker per state directory: an exclusive lock held for the broker's life (released
    by the OS when the process ends, however it ends). A second broker fails here, before it
    touches the socket or the database."""
    path = state_dir / "broker.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = ""
        with contextlib.suppress(OSError, ValueError, KeyError):
            holder = f" (pid {json.loads(broker_file_path_in(state_dir).read_text())['pid']})"
        raise XhpcError(
            f"another broker already runs on {state_dir}{holder}",
            hint="one broker per state directory; stop it first or use another state_dir",
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def socket_group_id(name: str) -> int:
    """The id of the group the control socket is shared with; this user must belong to it."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        raise XhpcError(
            f"broker.socket_group: no group named {name!r}", hint="see getent group"
        ) from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise XhpcError(
            f"broker.socket_group: you are not a member of group {name!r}",
            hint="share the socket with a group you belong to (id -Gn)",
        )
    return gid


def _share(state_dir: Path, sock_path: Path, config: XhpcConfig, gid: int | None) -> None:
    """Who may reach the control socket: its user (0600), a group (0660, the state directory
    0710 of that group), or every local user with ``shared_socket`` (0666, directory 0711).
    Whoever reaches it is still told apart by peer credentials (xhpc.broker.admit.authz)."""
    if config.broker.shared_socket:
        # A lab broker: every Unix user may call it. Replica directories and the DB stay
        # owner-only.
        os.chmod(state_dir, 0o711)
        os.chmod(sock_path, 0o666)
    elif gid is not None:
        os.chown(state_dir, -1, gid)
        os.chmod(state_dir, 0o710)
        os.chown(sock_path, -1, gid)
        os.chmod(sock_path, 0o660)
    else:
        os.chmod(sock_path, 0o600)


def _socket_gid(config: XhpcConfig) -> int | None:
    group = config.broker.socket_group
    return socket_group_id(group) if group is not None else None


SocketId = tuple[int, int, int]


def _identity(path: Path) -> SocketId:
    """Which socket file ``path`` is: its inode is not enough, since a filesystem gives a freed
    inode number to the next file made (a successor's socket, made after ours was unlinked);
    its change time tells them apart."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_ctime_ns


async def _bind(runner: web.AppRunner, path: Path, config: XhpcConfig) -> SocketId:
    """Serve ``runner`` on the Unix socket ``path`` (a stale one replaced), shared as the
    config says; the socket's identity (a successor's socket at this path is not ours)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old_umask = os.umask(0o177)  # the socket is created owner-only
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old_umask)
    _share(config.resolved_state_dir, path, config, _socket_gid(config))
    return _identity(path)


def _unbind(path: Path, ours: SocketId) -> None:
    """Remove our socket at ``path``, never a successor's."""
    with contextlib.suppress(FileNotFoundError):
        if _identity(path) == ours:
            path.unlink()


def _own_socket(sock_path: Path) -> tuple[Path, ...]:
    """This login node's socket beside ``sock_path``, unless its path is too long for one."""
    mine = host_socket_path(sock_path)
    if fits_socket(mine):
        return (mine,)
    log.warning("no socket of this login node: %s is too long for a Unix socket", mine)
    return ()


class StandbyRelay:
    """While a standby waits: its login node's socket (``host_socket_path``), relayed to the
    leader when that one runs on another login node (xhpc.broker.relay). A leader on this host
    serves the socket itself: then the standby serves nothing."""

    def __init__(self, config: XhpcConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.path = next(iter(_own_socket(control_socket_path(config))), None)
        self.runner: web.AppRunner | None = None
        self.ours: SocketId = (0, 0, 0)

    async def follow(self, state: LeaseState | None) -> None:
        elsewhere = state is not None and state.holder.partition(":")[0] != socket.gethostname()
        if not elsewhere or self.path is None:
            await self.close()
        elif self.runner is None and not listening(self.path):
            key = RelayKey(shared_secret(self.store, RELAY_SECRET))
            app = relay_app(broker_file_path(self.config), key, MAX_CONTROL_BODY)
            # A caller that hangs up cancels its call to the leader (a frozen leader holds
            # calls); the relay's end (this standby leads now) waits for none of them.
            runner = web.AppRunner(
                app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
            )
            await runner.setup()
            try:
                self.ours = await _bind(runner, self.path, self.config)
            except BaseException:
                await runner.cleanup()
                raise
            self.runner = runner
            log.info("standby: %s relays to the leader on another login node", self.path)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
            if self.path is not None:
                _unbind(self.path, self.ours)


def _holder_id() -> str:
    """This broker process, as the lease names its holder: host, pid and a nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def _gone_here(state: LeaseState) -> bool:
    """Whether the lease's holder was a broker of this host whose process has ended (killed):
    its lease need not be waited out."""
    host, _, rest = state.holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


async def lead(
    lease: Lease,
    stop: asyncio.Event,
    standby: bool,
    waiting: Callable[[LeaseState | None], Awaitable[None]] | None = None,
) -> bool:
    """Take the lease (True), or, as a standby, wait for it until ``stop`` (False), telling
    ``waiting`` each second who holds it. A broker that is no standby and finds the lease
    another's gets a one-line error."""
    if lease.acquire(_gone_here):
        log.info("broker leads (lease token %s)", lease.token)
        return True
    state = lease.state()
    leader = f"{state.holder} (lease token {state.token})" if state is not None else "another"
    if not standby:
        raise XhpcError(
            f"another broker leads on this state: {leader}",
            hint="stop it first, or start this one with `xhpc broker --standby` to take over "
            "when it stops",
        )
    log.info("standby: broker %s leads; this one takes over when its lease runs out", leader)
    while not stop.is_set():
        if waiting is not None:
            try:
                await waiting(lease.state())
            except (XhpcError, OSError) as err:
                log.warning("standby: %s", err)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
        if stop.is_set():
            break
        try:
            taken = lease.acquire(_gone_here)
        except LeaseUnreadable as err:  # the database busy: asked again in a second
            log.warning("standby: the lease could not be read: %s", err)
            continue
        if taken:
            log.info("standby takes over: broker leads (lease token %s, after %s)", lease.token,
                     leader)  # fmt: skip
            return True
    return False


async def keep_lease(lease: Lease, stop: asyncio.Event, lost: asyncio.Event) -> None:
    """Renew the lease every third of it; once another holds it, stop the broker."""
    every = lease.ttl.total_seconds() / 3
    while not stop.is_set():
        await asyncio.sleep(every)
        try:
            kept = lease.renew()
        except LeaseUnreadable as err:  # the database busy: the next renewal is in time
            log.warning("the lease could not be renewed now: %s", err)
            continue
        if not kept:
            log.error("this broker lost its lease to another: it stops")
            lost.set()
            stop.set()
            return


async def run_broker(
    config: XhpcConfig, stop: asyncio.Event | None = None, standby: bool = False
) -> None:
    state_dir = config.resolved_state_dir
    group = config.broker.socket_group
    if group is not None and not config.broker.shared_socket:
        socket_group_id(group)  # a one-line error before anything starts
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A standby shares the state directory with the leader: the lease decides, not the lock.
    lock_fd = None if standby else hold_state_lock(state_dir)
    try:
        await _run_broker(config, stop, standby)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


async def _run_broker(config: XhpcConfig, stop: asyncio.Event | None, standby: bool) -> None:
    store = Store(config.store_target)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lease = Lease(store, _holder_id(), config.broker.lease_s)
    relay = StandbyRelay(config, store)
    try:
        if not await lead(lease, stop, standby, relay.follow):
            return
    finally:
        await relay.close()  # a leader serves the login node's socket itself
    store.fence = lease.check  # every write checks the lease in its transaction
    lost = asyncio.Event()
    renewing = asyncio.create_task(keep_lease(lease, stop, lost))
    try:
        await _serve(config, store, stop, lease)
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        if not lost.is_set():
            with contextlib.suppress(XhpcError, OSError):
                lease.release()  # a standby takes over at once
    if lost.is_set():
        raise FencedError(
            "this broker lost its lease to another broker and stopped",
            hint="the other one leads now; start this one again with --standby",
        )


async def _serve(config: XhpcConfig, store: Store, stop: asyncio.Event, lease: Lease) -> None:
    state_dir = config.resolved_state_dir
    probes = ProbeBook(ensure_probe_token(state_dir))
    slurm = CliSlurmClient(config.slurm)
    slurm.guard = lease.assert_held  # no sbatch or scancel once another leads
    service = BrokerService(config, store, slurm, probes)
    slurm.timed = service.metrics.slurm_call  # every sbatch timed (xhpc.broker.metrics)
    service.proxies.epoch = lease.token or 0  # every routing table carries it

    # The leader's socket, and its login node's own (xhpc.broker.relay): the same API.
    sock_path = control_socket_path(config)
    sockets = (sock_path, *_own_socket(sock_path))
    control = web.AppRunner(control_app(service), access_log=None)
    await control.setup()
    ours = [await _bind(control, path, config) for path in sockets]

    agent = web.AppRunner(agent_app(service), access_log=None)
    await agent.setup()
    site = web.TCPSite(agent, config.broker.agent_bind, config.broker.agent_port)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    agent_url = f"http://{_advertise_host(config)}:{port}"
    found = {"agent_url": agent_url, "pid": os.getpid(), "started_at": utcnow().isoformat()}
    remote: web.AppRunner | None = None
    if config.broker.remote_control:
        token = ensure_token_file(control_token_path_in(state_dir))
        key = RelayKey(shared_secret(store, RELAY_SECRET))  # standbys' relays sign with it
        app = control_app(service, remote_token=token, relay_key=key)
        remote = web.AppRunner(app, access_log=None)
        await remote.setup()
        rsite = web.TCPSite(remote, config.broker.agent_bind, config.broker.remote_control_port)
        await rsite.start()
        assert rsite._server is not None
        rport = rsite._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        found["control_url"] = f"http://{_advertise_host(config)}:{rport}"
        found["relay"] = True  # it verifies relayed calls
    tmp = broker_file_path(config).with_suffix(".tmp")
    tmp.write_text(json.dumps(found))
    tmp.replace(broker_file_path(config))
    log.info("broker up: control %s, agents %s", sock_path, agent_url)

    task = asyncio.create_task(reconcile_loop(service, config.broker.reconcile_interval_s))
    # The catalog configures engines: read their schema now, not in a member's first serve.
    warm = asyncio.create_task(service.schemas.warm(config))
    try:
        await stop.wait()
    finally:
        for t in (task, warm):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await control.cleanup()
        await agent.cleanup()
        if remote is not None:
            await remote.cleanup()
        await service.adapter_desk.close()
        await service.autoscaler.close()
        for path, made in zip(sockets, ours, strict=True):
            _unbind(path, made)
        log.info("broker stopped")
