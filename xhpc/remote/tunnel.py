"""A local port forwarded over SSH (`ssh -L`, in paramiko): each connection to 127.0.0.1:PORT
on this machine becomes a `direct-tcpip` channel that the login node's sshd connects to HOST:PORT
(the lab's proxy, as the login node sees it)."""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable, Sequence

import paramiko

from xhpc.errors import RemoteError

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 15.0
_CHUNK = 65536


def _open(
    transport: paramiko.Transport, target: tuple[str, int], peer: tuple[str, int]
) -> paramiko.Channel:
    try:
        return transport.open_channel("direct-tcpip", target, peer, timeout=OPEN_TIMEOUT_S)
    except paramiko.ChannelException as err:
        raise RemoteError(
            f"the login node cannot reach {target[0]}:{target[1]}: {err.text}",
            hint="is the proxy running there? (xhpc proxy; or give it with --to HOST:PORT)",
        ) from err
    except (paramiko.SSHException, OSError, EOFError) as err:
        raise RemoteError(f"cannot open a channel to {target[0]}:{target[1]}: {err}") from err


def _relay(sock: socket.socket, channel: paramiko.Channel) -> None:
    """Bytes both ways until either side ends, then close both."""
    ends = sock.fileno(), channel.fileno()
    try:
        while True:
            ready, _, _ = select.select(ends, [], [], 30.0)
            if ends[0] in ready:
                data = sock.recv(_CHUNK)
                if not data:
                    break
                channel.sendall(data)
            if ends[1] in ready:
                data = channel.recv(_CHUNK)
                if not data:
                    break
                sock.sendall(data)
    except (OSError, EOFError, paramiko.SSHException) as err:
        log.debug("tunnel connection ended: %s", err)
    finally:
        channel.close()
        sock.close()


class Tunnel:
    """Listens on ``127.0.0.1:local_port`` (0: any free port; ``port`` tells which) and forwards
    each connection through ``transport`` to the first of ``targets`` (the site's gateways, one
    per login node) that the login node reaches: a target that refuses hands the preference to
    the next, for this connection and the ones after it."""

    def __init__(
        self,
        transport: paramiko.Transport,
        targets: Sequence[tuple[str, int]],
        local_port: int,
        *,
        on_error: Callable[[str], None] = log.warning,
    ) -> None:
        if not targets:
            raise RemoteError("no gateway to forward to")
        self._transport = transport
        self.targets = list(targets)
        self._preferred = 0
        self._on_error = on_error
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", local_port))
        except OSError as err:
            self._listener.close()
            raise RemoteError(
                f"cannot listen on 127.0.0.1:{local_port}: {err.strerror}",
                hint="choose another with --port (0: any free port)",
            ) from err
        self._listener.listen(64)
        self._listener.settimeout(1.0)
        self.port: int = self._listener.getsockname()[1]

    @property
    def target(self) -> tuple[str, int]:
        """The gateway connections go to now."""
        return self.targets[self._preferred]

    def check(self) -> None:
        """Fail now, with one line, when the login node reaches none of the targets."""
        self._open(("127.0.0.1", self.port)).close()

    def _open(self, peer: tuple[str, int]) -> paramiko.Channel:
        """A channel to the preferred target, else to the next one that opens."""
        first = self._preferred
        error: RemoteError | None = None
        for k in range(len(self.targets)):
            i = (first + k) % len(self.targets)
            try:
                channel = _open(self._transport, self.targets[i], peer)
            except RemoteError as err:
                error = error or err
                if len(self.targets) > 1:
                    self._on_error(f"{err.one_line()}; trying the next gateway")
                continue
            self._preferred = i
            return channel
        assert error is not None
        raise error

    def serve(self, stop: threading.Event) -> None:
        """Accept and forward until ``stop`` is set; RemoteError when the SSH connection ends."""
        try:
            while not stop.is_set():
                if not self._transport.is_active():
                    raise RemoteError("the SSH connection closed")
                try:
                    sock, peer = self._listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._forward, args=(sock, peer), daemon=True).start()
        finally:
            self._listener.close()

    def _forward(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        try:
            channel = self._open(peer)
        except RemoteError as err:
            self._on_error(err.one_line())
            sock.close()
            return
        _relay(sock, channel)
