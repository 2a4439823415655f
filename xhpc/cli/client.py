"""The CLI's client for the broker's control API (HTTP over the owner-only unix socket)."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from xhpc.errors import (
    AdmissionError,
    BrokerError,
    BrokerUnavailableError,
    NotFoundError,
    ValidationError,
    XhpcError,
)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("broker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._path))
        self.sock = sock


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
    raise BrokerError(message, status=status, code=code)


class BrokerClient:
    def __init__(self, socket_path: Path, timeout_s: float = 120.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: str | None = None) -> Any:
        conn = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            conn.request(
                method,
                path,
                body=body,
                headers={"Content-Type": "application/json"} if body else {},
            )
            resp = conn.getresponse()
            raw = resp.read()
        except (FileNotFoundError, ConnectionRefusedError) as err:
            raise BrokerUnavailableError(
                f"the xhpc broker is not running (no socket at {self.socket_path})",
                hint="start it with `xhpc broker` (or scripts/quickstart)",
            ) from err
        except OSError as err:
            raise BrokerUnavailableError(f"cannot talk to the broker: {err}") from err
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else {}
        except json.JSONDecodeError as err:
            raise BrokerError(
                "the broker answered something that is not JSON", status=resp.status
            ) from err
        if resp.status >= 400:
            _raise(resp.status, data if isinstance(data, dict) else {})
        return data

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: str) -> Any:
        return self.request("POST", path, body)

    def alive(self) -> bool:
        try:
            self.get("/v1/health")
        except XhpcError:
            return False
        return True
