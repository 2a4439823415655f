"""Per-key rate buckets shared by every worker of one gateway.

A key's requests-per-minute limit holds for the gateway, not per worker process: each key has
one small file (its bucket: tokens left and when they were counted) in the supervisor's private
directory (0700), read and written under an exclusive lock. Only requests of keys with a rate
limit pay for it: one lock, one read and one write of 16 bytes on an open file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
from pathlib import Path

_BUCKET = struct.Struct("dd")  # tokens, at (monotonic seconds: one clock for the whole machine)


class SharedBuckets:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._fds: dict[str, int] = {}

    def _fd(self, key_id: str) -> int:
        fd = self._fds.get(key_id)
        if fd is None:
            name = hashlib.sha256(key_id.encode()).hexdigest()[:32]
            fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT, 0o600)
            self._fds[key_id] = fd
        return fd

    def take(self, key_id: str, rpm: int, now: float) -> float:
        """Take one token from the key's bucket (refilled at ``rpm`` a minute, holding at most
        ``rpm``); the tokens there were before, so < 1.0 means refused (nothing taken)."""
        fd = self._fd(key_id)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, _BUCKET.size, 0)
            tokens, at = float(rpm), now
            if len(raw) == _BUCKET.size:
                tokens, at = (float(v) for v in _BUCKET.unpack(raw))
            tokens = min(float(rpm), tokens + max(0.0, now - at) * rpm / 60.0)
            left = tokens - 1.0 if tokens >= 1.0 else tokens
            os.pwrite(fd, _BUCKET.pack(left, now), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return tokens

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
