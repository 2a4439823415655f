"""Each key's requests in flight and tokens reserved, summed over every worker of one gateway.

A key's concurrency cap and token quota hold for the gateway, not per worker process. Each worker
keeps its own counts (``xhpc.proxy.tenants.quota.Holds``) and publishes them for every key with a
cap or a quota in one small file per key and worker (``KEY.WORKER``: two 64-bit counts) in the
supervisor's private directory (0700). A worker admitting a request reads the other workers'
files of that key under the key's lock (``KEY.lock``) and writes its own in the same step, so two
workers cannot both take the last slot. A worker that exits, however it ends, has its files
removed by the supervisor (``forget``): a dead worker's holds are given back, never left held.
Only requests of keys with a cap or a quota pay: one lock and a read of a few 16-byte files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

HOLDS_DIR = "holds"  # under the supervisor's private directory
_COUNTS = struct.Struct("qq")  # requests in flight, tokens reserved
_LOCK = ".lock"


def _key_name(key_id: str) -> str:
    return hashlib.sha256(key_id.encode()).hexdigest()[:32]


class SharedHolds:
    def __init__(self, directory: Path, worker: str) -> None:
        if "." in worker or "/" in worker or not worker:
            raise ValueError(f"worker name {worker!r}: no dots or slashes")
        self.dir = directory
        self.worker = worker
        self.dir.mkdir(mode=0o700, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self, key_id: str) -> Iterator[str]:
        name = _key_name(key_id)
        fd = os.open(self.dir / f"{name}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield name
        finally:
            os.close(fd)  # releases the lock

    def _others(self, name: str) -> tuple[int, int]:
        in_flight = reserved = 0
        for path in self.dir.glob(f"{name}.*"):
            suffix = path.name[len(name) + 1 :]
            if suffix == self.worker or path.name.endswith(_LOCK):
                continue
            with contextlib.suppress(OSError, struct.error):
                a, b = _COUNTS.unpack(path.read_bytes())
                in_flight, reserved = in_flight + a, reserved + b
        return in_flight, reserved

    def _publish(self, name: str, in_flight: int, reserved: int) -> None:
        path = self.dir / f"{name}.{self.worker}"
        if in_flight == 0 and reserved == 0:
            path.unlink(missing_ok=True)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, _COUNTS.pack(in_flight, reserved), 0)
        finally:
            os.close(fd)

    def others(self, key_id: str) -> tuple[int, int]:
        """What the other workers hold of the key: (requests in flight, tokens reserved)."""
        with self._locked(key_id) as name:
            return self._others(name)

    def admit(self, key_id: str, cap: int, in_flight: int, reserved: int) -> bool:
        """With this worker holding ``in_flight`` and ``reserved`` of the key, one request more
        unless the gateway already has ``cap`` in flight; published when admitted."""
        with self._locked(key_id) as name:
            if self._others(name)[0] + in_flight >= cap:
                return False
            self._publish(name, in_flight + 1, reserved)
            return True

    def publish(self, key_id: str, in_flight: int, reserved: int) -> None:
        """This worker's counts of the key, as they are now."""
        with self._locked(key_id) as name:
            self._publish(name, in_flight, reserved)

    @staticmethod
    def forget(directory: Path, worker: str) -> None:
        """Give back every hold of ``worker`` (it exited)."""
        for path in directory.glob(f"*.{worker}"):
            path.unlink(missing_ok=True)
