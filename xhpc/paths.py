"""Where the broker's files live in the state directory (adapter layer; no I/O but finding
which control socket answers).

The broker creates them (xhpc.broker.server, xhpc.broker.watch.probes); the CLI, the proxy and
the probe only need to find them, without importing the broker.
"""

from __future__ import annotations

import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from xhpc.peers import listening

if TYPE_CHECKING:  # pydantic: `xhpc ps` finds the socket from the state directory alone
    from xhpc.settings import XhpcConfig

CONTROL_SOCKET_FILE = "broker.sock"  # the control API (0600; 0666 for a lab broker)
BROKER_FILE = "broker.json"  # the broker's address for agents and probes, rewritten at each start
PROBE_TOKEN_FILE = "probe.token"  # the node token probes present (0600)
# what a job of the broker's user presents on the control API over TCP (0600)
CONTROL_TOKEN_FILE = "control.token"


def host_name() -> str:
    """This login node's short host name, as its broker's own socket is named."""
    name = socket.gethostname().split(".")[0]
    return "".join(c for c in name if c.isalnum() or c in "-_")[:40] or "host"


def host_socket_path(path: Path, host: str | None = None) -> Path:
    """The socket of this login node's own broker beside ``path`` (the leader's socket):
    ``broker.sock`` -> ``broker.<host>.sock``. Every broker serves one: the leader its control
    API, a standby whose leader is on another login node a relay to it (xhpc.broker.relay)."""
    return path.with_name(f"{path.stem}.{host or host_name()}{path.suffix}")


def fits_socket(path: Path) -> bool:
    """Whether ``path`` is short enough for a Unix socket (108 bytes with its final NUL)."""
    return len(str(path).encode()) < 108


def reachable_socket(path: Path) -> Path:
    """Where a client on this host reaches the broker of ``path``, at each connection: this
    login node's own broker's socket when one answers there (a state shared by two login
    nodes: the leader's socket on a shared filesystem is another host's), else ``path`` (a
    single login node; or this node's broker killed, its socket file left behind)."""
    mine = host_socket_path(path)
    try:
        if not stat.S_ISSOCK(mine.stat().st_mode):
            return path
    except OSError:
        return path
    return mine if listening(mine, timeout_s=0.5) else path


def control_socket_path_in(state_dir: Path) -> Path:
    return state_dir / CONTROL_SOCKET_FILE


def control_socket_path(config: XhpcConfig) -> Path:
    return control_socket_path_in(config.resolved_state_dir)


def control_token_path_in(state_dir: Path) -> Path:
    return state_dir / CONTROL_TOKEN_FILE


def broker_file_path_in(state_dir: Path) -> Path:
    return state_dir / BROKER_FILE


def broker_file_path(config: XhpcConfig) -> Path:
    return broker_file_path_in(config.resolved_state_dir)
