"""The command line of remote use, without SSH: which of the `xhpc` group's options are the
connection's, what is sent as is, where to connect, and the one line the remote shell runs.

Pure and light: `xhpc`'s entry point imports it on every run (paramiko is imported only when a
remote command runs)."""

from __future__ import annotations

import getpass
import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from xhpc.errors import ValidationError

# The `xhpc` group's options of the connection: their values stay on this machine.
REMOTE_VALUE_OPTIONS = frozenset({"--remote", "--identity", "--remote-xhpc", "--known-hosts"})
REMOTE_FLAGS = frozenset({"--accept-new-host-key"})
DEFAULT_REMOTE_XHPC = "xhpc"
# Commands that run on this machine and use the connection themselves.
LOCAL_COMMANDS = frozenset({"tunnel"})


@dataclass(frozen=True)
class RemoteOptions:
    """The connection's options as given (``destination`` is `[USER@]HOST[:PORT]`)."""

    destination: str
    identities: tuple[str, ...] = ()
    remote_xhpc: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False


@dataclass(frozen=True)
class RemoteSplit:
    options: RemoteOptions
    forwarded: list[str] = field(default_factory=list)  # the rest of argv, sent as is
    command: str | None = None  # the command's name, if any


def split_remote(argv: Sequence[str], group_value_options: Collection[str]) -> RemoteSplit | None:
    """Take the connection's options from the group's options (those before the command's
    name); None when there is no `--remote`. ``group_value_options``: the group's other options
    that take a value (their value is not the command's name). Everything else, in its order,
    is sent as is."""
    values: dict[str, list[str]] = {}
    flags: set[str] = set()
    forwarded: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            break
        name, eq, value = token.partition("=")
        if name in REMOTE_VALUE_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValidationError(f"option {name} needs a value")
                value = argv[i + 1]
                i += 1
            values.setdefault(name, []).append(value)
        elif token in REMOTE_FLAGS:
            flags.add(token)
        else:
            forwarded.append(token)
            if token in group_value_options and i + 1 < len(argv):
                forwarded.append(argv[i + 1])
                i += 1
        i += 1
    if "--remote" not in values:
        return None
    for name, given in values.items():
        if name != "--identity" and len(given) > 1:
            raise ValidationError(f"option {name} given {len(given)} times")
    options = RemoteOptions(
        destination=values["--remote"][0],
        identities=tuple(values.get("--identity", ())),
        remote_xhpc=values.get("--remote-xhpc", [None])[0],
        known_hosts=values.get("--known-hosts", [None])[0],
        accept_new_host_key="--accept-new-host-key" in flags,
    )
    command = argv[i] if i < len(argv) and argv[i] != "--" else None
    return RemoteSplit(options, [*forwarded, *argv[i:]], command)


@dataclass(frozen=True)
class Destination:
    user: str
    host: str
    port: int = 22

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}" + (f":{self.port}" if self.port != 22 else "")


def parse_destination(text: str, default_user: str | None = None) -> Destination:
    """`[USER@]HOST[:PORT]`; an IPv6 address in brackets (`[::1]:2222`). The user defaults to
    this machine's."""
    user, at, rest = text.rpartition("@")
    if not at:
        user = default_user or getpass.getuser()
    port_text = ""
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValidationError(f"--remote {text!r}: expected [USER@]HOST[:PORT]")
        port_text = tail[1:]
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host = rest
    bad = not host or not user or any(c.isspace() or c in "/@'\"`$;" for c in user + host)
    if bad or (port_text and not port_text.isdigit()) or host.startswith("-"):
        raise ValidationError(f"--remote {text!r}: expected [USER@]HOST[:PORT]")
    port = int(port_text) if port_text else 22
    if not 0 < port < 65536:
        raise ValidationError(f"--remote {text!r}: port {port} is out of range")
    return Destination(user=user, host=host, port=port)


def remote_command(remote_xhpc: str, args: Sequence[str]) -> str:
    """The one line the login node's shell runs: the remote `xhpc` (split into words here, as a
    shell would, so it may be `/opt/venv/bin/python -m xhpc`) and every argument, each quoted:
    the remote shell reads none of them as anything but one word."""
    try:
        words = shlex.split(remote_xhpc)
    except ValueError as err:
        raise ValidationError(f"remote xhpc {remote_xhpc!r}: {err}") from err
    if not words:
        raise ValidationError("remote xhpc is empty")
    return shlex.join([*words, *args])
