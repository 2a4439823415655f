"""Where the broker's files live in the state directory (adapter layer; no I/O).

The broker creates them (xhpc.broker.server, xhpc.broker.watch.probes); the CLI, the proxy and
the probe only need to find them, without importing the broker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic: `xhpc ps` finds the socket from the state directory alone
    from xhpc.settings import XhpcConfig

CONTROL_SOCKET_FILE = "broker.sock"  # the control API (0600; 0666 for a lab broker)
BROKER_FILE = "broker.json"  # the broker's address for agents and probes, rewritten at each start
PROBE_TOKEN_FILE = "probe.token"  # the node token probes present (0600)
# what a job of the broker's user presents on the control API over TCP (0600)
CONTROL_TOKEN_FILE = "control.token"


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
