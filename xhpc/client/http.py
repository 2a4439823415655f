"""The transport to the broker's control API: HTTP/1.1 over its unix socket, JSON in and out,
the broker's errors raised as xhpc's (no pydantic: `xhpc ps` uses it as it is).

One request per connection (``Connection: close``), written and read here: http.client would
import ssl and the email package, a tenth of what `xhpc ps` may take (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from xhpc.errors import (
    AdmissionError,
    BrokerError,
    BrokerUnavailableError,
    NotFoundError,
    ValidationError,
    XhpcError,
)
from xhpc.paths import reachable_socket
from xhpc.wire import WIRE_HEADER, WIRE_VERSION


def _exchange(
    address: Path | tuple[str, int], timeout: float, request: bytes, body: BinaryIO | None = None
) -> bytes:
    """Send ``request`` (and then ``body``, a file, as it is read) to the unix socket at
    ``address`` (or TCP ``(host, port)``); the whole answer, read to its end."""
    family = socket.AF_UNIX if isinstance(address, Path) else socket.AF_INET
    if not isinstance(address, Path) and ":" in address[0]:
        family = socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(address) if isinstance(address, Path) else address)
        sock.sendall(request)
        if body is not None:
            # The broker may refuse it midway (over its limit): its answer says why.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendfile(body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _unchunk(body: bytes) -> bytes:
    """A ``Transfer-Encoding: chunked`` body decoded; ValueError when it is cut short."""
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";", 1)[0], 16)
        if size == 0:
            return bytes(out)
        start = end + 2
        if len(body) < start + size + 2:
            raise ValueError("chunk cut short")
        out += body[start : start + size]
        pos = start + size + 2


def _parse(raw: bytes) -> tuple[int, bytes]:
    """An HTTP/1.1 answer's status and body; ValueError when it is not a whole one."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = [*status_line.split(" ", 2), ""]
    if not sep or not version.startswith("HTTP/1.") or not (status.isdigit() and len(status) == 3):
        raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return int(status), _unchunk(body)
    length = headers.get("content-length")
    if length is not None:
        if len(body) < int(length):
            raise ValueError(f"answer cut short ({len(body)} of {length} bytes)")
        body = body[: int(length)]
    return int(status), body


def _raise(status: int, body: dict[str, Any]) -> None:
    err = body.get("error") or {}
    code = str(err.get("code", "broker_error"))
    message = str(err.get("message", f"broker answered HTTP {status}"))
    hint = err.get("hint")
    if code == "admission_failed":
        raise AdmissionError(list(err.get("problems") or [message]), hint=hint)
    if status == 404 or code == "not_found":
        raise NotFoundError(message, hint=hint)
    if status == 400:
        raise ValidationError(message, hint=hint)
    if code == "slurm_error":
        raise XhpcError(message, hint=hint)
    if code == "broker_unavailable":  # a relay whose leader does not answer (xhpc.broker.relay)
        raise BrokerUnavailableError(message, hint=hint)
    raise BrokerError(message, status=status, code=code)


class BrokerTransport:
    """Raw JSON requests to one broker; ``xhpc.client.Client`` types them."""

    def __init__(self, socket_path: Path, timeout_s: float = 120.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._address: Path | tuple[str, int] = socket_path
        self._auth = ""  # an Authorization header line, over TCP

    @classmethod
    def over_tcp(
        cls, url: str, token: str, socket_path: Path, timeout_s: float = 120.0
    ) -> BrokerTransport:
        """The broker's control API over TCP (``url``: http://HOST:PORT, from its broker.json),
        presenting the control ``token``: what a job on a compute node uses."""
        parsed = urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValidationError(f"not a broker address: {url!r}")
        if not token or not token.isprintable() or any(c in token for c in " \r\n"):
            raise ValidationError("the control token is empty or not one line of text")
        transport = cls(socket_path, timeout_s)
        transport._address = (parsed.hostname, parsed.port)
        transport._auth = f"Authorization: Bearer {token}\r\n"
        return transport

    @property
    def remote_host(self) -> str | None:
        """The broker's host over TCP; None on the unix socket."""
        return None if isinstance(self._address, Path) else self._address[0]

    @property
    def where(self) -> str:
        """The broker's address, for messages (never the token)."""
        if isinstance(self._address, Path):
            return str(self._address)
        host, port = self._address
        return f"http://{host}:{port}"

    def request(
        self,
        method: str,
        path: str,
        body: str | None = None,
        headers: Mapping[str, str] | None = None,
        upload: Path | None = None,
    ) -> Any:
        """``path``: built by ``xhpc.ids.control_path``; ``headers``: more header lines (each
        name and value one printable line); ``upload``: a file sent as the body, as it is
        read (never whole in memory)."""
        if not (path.isascii() and path.isprintable()) or " " in path:  # a name as typed
            raise ValidationError(f"not a request path: {path!r}")
        payload = body.encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n{self._auth}"
        head += f"{WIRE_HEADER}: {WIRE_VERSION}\r\n"
        for name, value in (headers or {}).items():
            if not (f"{name}{value}".isascii() and f"{name}{value}".isprintable()) or ":" in name:
                raise ValidationError(f"not a header: {name!r}")
            head += f"{name}: {value}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        with contextlib.ExitStack() as stack:
            sent = None
            if upload is not None:
                try:
                    sent = stack.enter_context(upload.open("rb"))
                except OSError as err:
                    raise ValidationError(f"cannot read {upload}: {err.strerror}") from err
                size = os.fstat(sent.fileno()).st_size
                head += f"Content-Type: application/jsonl\r\nContent-Length: {size}\r\n"
            raw = self._send(f"{head}\r\n".encode() + payload, sent)
        try:
            status, content = _parse(raw)
        except ValueError as err:
            raise BrokerUnavailableError(f"cannot talk to the broker: {err}") from err
        try:
            data = json.loads(content) if content else {}
        except json.JSONDecodeError as err:
            raise BrokerError(
                "the broker answered something that is not JSON", status=status
            ) from err
        if status >= 400:
            _raise(status, data if isinstance(data, dict) else {})
        return data

    def _send(self, request: bytes, body: BinaryIO | None) -> bytes:
        address = self._address
        if isinstance(address, Path):
            address = reachable_socket(address)
        try:
            return _exchange(address, self.timeout_s, request, body)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if not isinstance(self._address, Path):
                raise BrokerUnavailableError(
                    f"the xhpc broker is not running (nothing listens at {self.where})",
                    hint="start it with `xhpc broker`",
                ) from err
            what = "no socket" if isinstance(err, FileNotFoundError) else "nothing answers"
            raise BrokerUnavailableError(
                f"the xhpc broker is not running ({what} at {self.where}, in state directory "
                f"{self._address.parent})",
                hint="start it with `xhpc broker` and the same config",
                state_dir=self._address.parent,
            ) from err
        except OSError as err:
            raise BrokerUnavailableError(f"cannot talk to the broker: {err}") from err

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> Any:
        return self.request("GET", path, headers=headers)

    def post(self, path: str, body: str, headers: Mapping[str, str] | None = None) -> Any:
        return self.request("POST", path, body, headers)

    def alive(self) -> bool:
        try:
            self.get("/v1/health")
        except XhpcError:
            return False
        return True
