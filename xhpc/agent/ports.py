"""Who listens on a port: the agent sends the replica's secret only to the engine it started.

The agent picks a free port, releases it and starts the engine, which binds it a moment later:
in between a process on the node that names the port may take it (the agent picks outside the
kernel's ephemeral range, so no connection or port-0 bind gets it by chance). Before each
readiness probe (it carries the secret) the agent reads the kernel's socket table
(/proc/net/tcp and tcp6: every socket of this network namespace, whoever owns it) for the
sockets listening on the port, and the socket inodes the engine and its descendants hold
(/proc/PID/fd). Every listener must be the engine's. Reading the table costs a few
milliseconds however many processes the node runs.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]

from xhpc.errors import EngineError

PROC = Path("/proc")
EPHEMERAL = PROC / "sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below: the well-known and registered services a site may run
_pick = random.SystemRandom()
_LISTEN = "0A"  # TCP_LISTEN in the kernel's table


def ephemeral_range(path: Path = EPHEMERAL) -> tuple[int, int]:
    """The kernel's range for the ports it picks itself (connections, binds to port 0)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port(path: Path = EPHEMERAL) -> int:
    """A port free right now on every address of this node, outside the kernel's ephemeral
    range: once the agent lets it go the kernel never hands it to another program's
    connection or port-0 bind (an engine's own sockets included, or the other half of a PD
    pair on the node). Only a program that names the port could take it before the engine
    binds it: see ``engine_listens``."""
    low, high = ephemeral_range(path)
    ports = [*range(LOWEST_PORT, max(low, LOWEST_PORT)), *range(high + 1, 65536)]
    for _ in range(64 if ports else 0):
        port: int = _pick.choice(ports)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room outside: the kernel's
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> frozenset[int]:
    """``pid`` and its descendants (empty once it is gone)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return frozenset()
    return frozenset({pid, *(int(c.pid) for c in children)})


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` (any address, IPv4 and IPv6)."""
    found: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 on this node
        except OSError as err:
            raise EngineError(f"cannot tell who listens on port {port}: {err}") from err
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            local_port = fields[1].rsplit(":", 1)[-1]
            if int(local_port, 16) == port:
                found.add(int(fields[9]))
    return found


def socket_inodes(pids: frozenset[int], proc: Path = PROC) -> set[int]:
    """The socket inodes held open by ``pids`` (processes that end meanwhile are skipped)."""
    found: set[int] = set()
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target.endswith("]"):
                found.add(int(target[8:-1]))
    return found


def engine_listens(port: int, engine_pid: int, proc: Path = PROC) -> bool:
    """True once the engine (``engine_pid`` or a descendant) listens on ``port``; False while
    nothing does. EngineError when any other process listens on it: the port was taken
    between the agent's pick and the engine's start, and the secret must not go there."""
    listening = listening_inodes(port, proc)
    if not listening:
        return False
    strangers = listening - socket_inodes(process_tree(engine_pid), proc)
    if strangers:
        raise EngineError(
            f"port {port} is held by another process, not by the engine (pid {engine_pid}) "
            f"the agent started: not sending it the replica's secret",
            hint="another program on the node took the port first; start the replica again",
        )
    return True
