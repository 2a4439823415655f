"""Who is at the other end of a Unix socket: the peer credentials the kernel records
(``SO_PEERCRED``), which a process cannot forge, and the Unix user name of a uid."""

from __future__ import annotations

import pwd
import socket
import struct
from pathlib import Path
from typing import Any

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of the Unix socket ``sock`` (a socket or
    asyncio's ``TransportSocket``); None for another kind of socket, or none."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    _pid, uid, _gid = _CREDS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    )
    return int(uid)


def user_name(uid: int) -> str:
    """The user's name, or ``uid<N>`` for a uid with no entry in the user database."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def listening(path: Path, timeout_s: float = 2.0) -> bool:
    """Whether a process of this host listens on the Unix socket ``path`` (a socket file on a
    shared filesystem, made by another host, refuses)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
    except OSError:
        return False
    return True
