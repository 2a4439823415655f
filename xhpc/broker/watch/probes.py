"""Probe reports from the nodes: the node token, and the latest report of each node (in memory)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from xhpc.models import ProbeReport
from xhpc.paths import PROBE_TOKEN_FILE


def ensure_probe_token(state_dir: Path) -> str:
    """The node token probes present; made once (0600) and kept across broker restarts."""
    return ensure_token_file(state_dir / PROBE_TOKEN_FILE)


def ensure_token_file(path: Path) -> str:
    """The secret in ``path``; made once (0600) and kept across broker restarts."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        return token


class ProbeBook:
    """The newest report per node. Reports are ephemeral: they are never written to SQLite."""

    def __init__(self, token: str) -> None:
        self._token_hash = hashlib.sha256(token.encode()).digest()
        self._reports: dict[str, ProbeReport] = {}

    def authorized(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode()).digest()
        return hmac.compare_digest(digest, self._token_hash)

    def put(self, report: ProbeReport) -> None:
        current = self._reports.get(report.node)
        if current is None or report.taken_at >= current.taken_at:
            self._reports[report.node] = report

    def reports(self) -> dict[str, ProbeReport]:
        return dict(self._reports)
