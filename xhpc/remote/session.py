"""An SSH connection to the login node (paramiko): host keys checked against known_hosts, keys
from the agent or files, one command run with its output streamed and its exit code kept.

No pty and no environment are sent: the command's stdout and stderr stay apart, byte for byte,
and nothing of this machine's environment (API keys in `OPENAI_API_KEY`, say) reaches the login
node."""

from __future__ import annotations

import logging
import os
import select
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import paramiko

from xhpc.errors import HostKeyError, RemoteError
from xhpc.remote.argv import Destination

log = logging.getLogger(__name__)

SSHClient = paramiko.SSHClient  # for the CLI's annotations (it imports no paramiko)

SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
CONNECT_TIMEOUT_S = 20.0
KEEPALIVE_S = 30
_CHUNK = 32768


@dataclass(frozen=True)
class SshSettings:
    """How to reach and trust the login node."""

    destination: Destination
    identities: tuple[Path, ...] = ()
    known_hosts: Path = Path("~/.ssh/known_hosts")
    accept_new_host_key: bool = False
    connect_timeout_s: float = CONNECT_TIMEOUT_S


def fingerprint(key: paramiko.PKey) -> str:
    """As OpenSSH prints it: `ssh-ed25519 SHA256:…`."""
    return f"{key.get_name()} {key.fingerprint}"


def _host_entry(dest: Destination) -> str:
    return dest.host if dest.port == 22 else f"[{dest.host}]:{dest.port}"


class _UnknownHostKey(paramiko.MissingHostKeyPolicy):
    """Refuse a host not in known_hosts, or (``accept_new``) add it there and say so."""

    def __init__(self, settings: SshSettings, known_hosts: Path) -> None:
        self._settings = settings
        self._file = known_hosts

    def missing_host_key(self, client: SSHClient, hostname: str, key: paramiko.PKey) -> None:
        dest = str(self._settings.destination)
        if not self._settings.accept_new_host_key:
            raise HostKeyError(
                f"{dest}: host key {fingerprint(key)} is not in {self._file}; refusing to connect",
                destination=dest,
                fingerprint=fingerprint(key),
                hint="compare the fingerprint with the one your lab publishes, then add it"
                " (ssh once, or xhpc --accept-new-host-key)",
            )
        self._file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        fd = os.open(self._file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)
        print(
            f"xhpc: added {hostname}'s host key {fingerprint(key)} to {self._file}", file=sys.stderr
        )


def connect(settings: SshSettings) -> SSHClient:
    """A connected, authenticated client; RemoteError (HostKeyError) with one line otherwise."""
    dest = settings.destination
    known_hosts = settings.known_hosts.expanduser()
    client = paramiko.SSHClient()
    try:
        if SYSTEM_KNOWN_HOSTS.is_file() and os.access(SYSTEM_KNOWN_HOSTS, os.R_OK):
            client.load_system_host_keys(str(SYSTEM_KNOWN_HOSTS))
        if known_hosts.is_file():
            client.load_host_keys(str(known_hosts))
    except (OSError, paramiko.SSHException) as err:
        raise RemoteError(f"cannot read known_hosts {known_hosts}: {err}") from err
    client.set_missing_host_key_policy(_UnknownHostKey(settings, known_hosts))
    try:
        client.connect(
            dest.host,
            port=dest.port,
            username=dest.user,
            # a list is documented (and tried in order); the stub says str
            key_filename=[str(p.expanduser()) for p in settings.identities] or None,  # type: ignore[arg-type]
            allow_agent=True,
            look_for_keys=True,
            timeout=settings.connect_timeout_s,
            banner_timeout=settings.connect_timeout_s,
            auth_timeout=settings.connect_timeout_s,
        )
    except HostKeyError:
        client.close()
        raise
    except paramiko.BadHostKeyException as err:
        client.close()
        raise HostKeyError(
            f"{dest}: host key {fingerprint(err.key)} does not match the one in"
            f" {known_hosts} ({fingerprint(err.expected_key)}); refusing to connect",
            destination=str(dest),
            fingerprint=fingerprint(err.key),
            expected=fingerprint(err.expected_key),
            hint="the login node may have been reinstalled, or someone is in between: ask your"
            " lab's admins before removing the old key",
        ) from err
    except paramiko.PasswordRequiredException as err:
        client.close()
        raise RemoteError(
            f"{dest}: a key needs its passphrase", hint="load it into ssh-agent (ssh-add)"
        ) from err
    except paramiko.AuthenticationException as err:
        client.close()
        raise RemoteError(
            f"{dest}: authentication failed ({err})",
            destination=str(dest),
            hint="xhpc uses ssh-agent and ~/.ssh/id_* keys, or --identity FILE",
        ) from err
    except (paramiko.SSHException, OSError, EOFError) as err:
        client.close()
        raise RemoteError(f"{dest}: cannot connect: {err or type(err).__name__}") from err
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(KEEPALIVE_S)
    return client


def _transport(client: paramiko.SSHClient) -> paramiko.Transport:
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise RemoteError("the SSH connection closed")
    return transport


def run(
    client: SSHClient,
    command: str,
    *,
    stdout: BinaryIO,
    stderr: BinaryIO,
) -> int:
    """Run one command line on the login node; its output goes to ``stdout``/``stderr`` as it
    comes. Its stdin is empty (no xhpc command reads one). Returns the command's exit code."""
    try:
        channel = _transport(client).open_session()
        channel.exec_command(command)
    except (paramiko.SSHException, OSError, EOFError) as err:
        raise RemoteError(f"cannot start the remote command: {err}") from err
    channel.shutdown_write()
    with channel:
        # The channel's fileno is readable when either stream has data, or at its end.
        while True:
            if channel.recv_ready():
                _write(stdout, channel.recv(_CHUNK))
            elif channel.recv_stderr_ready():
                _write(stderr, channel.recv_stderr(_CHUNK))
            elif channel.eof_received or channel.closed:
                break
            else:
                select.select([channel], [], [], 1.0)
        while channel.recv_ready() or channel.recv_stderr_ready():  # what came with the end
            if channel.recv_ready():
                _write(stdout, channel.recv(_CHUNK))
            if channel.recv_stderr_ready():
                _write(stderr, channel.recv_stderr(_CHUNK))
        code = channel.recv_exit_status()
    if code < 0:  # killed by a signal: paramiko keeps no status
        raise RemoteError("the remote command ended without an exit status (killed?)")
    return code


def _write(out: BinaryIO, data: bytes) -> None:
    out.write(data)
    out.flush()


@dataclass(frozen=True)
class Captured:
    code: int
    stdout: bytes
    stderr: bytes


def capture(client: SSHClient, command: str) -> Captured:
    """Run one command line and keep its output (for a few kilobytes, such as a config)."""
    import io

    out, err = io.BytesIO(), io.BytesIO()
    code = run(client, command, stdout=out, stderr=err)
    return Captured(code, out.getvalue(), err.getvalue())
