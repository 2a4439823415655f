"""The proxy workers' metric snapshots as files (decision 0010): their format, reading them back
(files written by our own processes, still checked), and a worker's side of sharing them
(``SharedMetrics``: publish its own, gather its peers' and the retired workers' sums)."""

from __future__ import annotations

import json
import logging
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

from xhpc.prometheus import Labels

logger = logging.getLogger(__name__)

Snapshot = dict[str, Any]
"""One process's figures, as JSON: ``v``, ``pid``, ``counters`` (name -> [[labels, value]]),
``histograms`` (name -> [[labels, bucket counts, sum]]), ``in_flight`` (replica -> requests)
and ``breakers`` (replica -> state value); ``retired.json`` has no pid and no gauges."""

SNAPSHOT_VERSION = 1
PUBLISH_INTERVAL_S = 1.0
SNAPSHOT_SUFFIX = ".json"
RETIRED_FILE = "retired.json"
_GATHER_TRIES = 5


# --- reading snapshots (files written by our own processes, still checked) ---


def labels_of(raw: object, arity: int) -> Labels | None:
    if not isinstance(raw, list) or len(raw) != arity:
        return None
    if not all(isinstance(v, str) for v in raw):
        return None
    return tuple(raw)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def exact(raw: object) -> Fraction | None:
    """A snapshot's value: a JSON number (a worker's float), or [numerator, denominator]."""
    try:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return Fraction(raw)
        if isinstance(raw, list) and len(raw) == 2 and all(is_count(n) for n in raw):
            return Fraction(raw[0], raw[1])
    except (ValueError, OverflowError, ZeroDivisionError):  # inf, nan, a zero denominator
        pass
    return None


def counter_entries(snap: Snapshot, name: str) -> object:
    counters = snap.get("counters")
    return counters.get(name) if isinstance(counters, dict) else None


def replicas_of(entries: object) -> set[str]:
    """The replicas of a counter labelled by replica alone, in a snapshot."""
    if not isinstance(entries, list):
        return set()
    found = set()
    for entry in entries:
        if isinstance(entry, list) and entry:
            labels = labels_of(entry[0], 1)
            if labels is not None:
                found.add(labels[0])
    return found


def number_map(raw: object) -> dict[str, float]:
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and is_number(v)}


def parse(data: bytes | None) -> Snapshot | None:
    if not data:
        return None
    try:
        snap = json.loads(data)
    except ValueError:
        return None
    if not isinstance(snap, dict) or snap.get("v") != SNAPSHOT_VERSION:
        return None
    return snap


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # gone (a worker that exited, folded into retired.json) or unreadable
        return None


def dumps(doc: Snapshot) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a reader sees the old file or the new one),
    the file readable by its owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SharedMetrics:
    """A worker's side of the figures every worker shares (decision 0010): its snapshot file
    ``<name>.json`` in ``directory``, and the other workers' and ``retired.json`` read back."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.path = directory / f"{name}{SNAPSHOT_SUFFIX}"
        self.pid = os.getpid()  # the ``worker`` label of its gauges
        self._written: bytes | None = None
        self._failing = False

    def publish(self, snap: Snapshot) -> None:
        """Write ``snap`` unless it is what was written last."""
        data = dumps(snap)
        if data == self._written:
            return
        try:
            write_private(self.path, data)
        except OSError as err:
            if not self._failing:
                logger.warning("cannot publish this worker's metrics to %s: %s", self.path, err)
            self._failing = True
            return
        self._failing = False
        self._written = data

    def gather(self) -> tuple[list[tuple[str, Snapshot]], Snapshot | None]:
        """The other workers' snapshots (by file name) and ``retired.json``, read consistently:
        a worker the supervisor folds into ``retired.json`` meanwhile is counted once, never
        twice or not at all (``retired.json`` names the worker it folded in last, before its
        file goes; if ``retired.json`` changed during the read, it is read again)."""
        retired_path = self.directory / RETIRED_FILE
        peers: list[tuple[str, Snapshot]] = []
        retired: Snapshot | None = None
        for _ in range(_GATHER_TRIES):
            before = read(retired_path)
            retired = parse(before)
            skip = {self.path.name, RETIRED_FILE}
            absorbed = retired.get("absorbed") if retired is not None else None
            if isinstance(absorbed, list):
                skip.update(f"{n}{SNAPSHOT_SUFFIX}" for n in absorbed if isinstance(n, str))
            try:
                names = sorted(os.listdir(self.directory))
            except OSError:
                names = []
            peers = []
            for name in names:
                if name in skip or name.startswith(".") or not name.endswith(SNAPSHOT_SUFFIX):
                    continue
                snap = parse(read(self.directory / name))
                if snap is not None:
                    peers.append((name, snap))
            if read(retired_path) == before:
                break
        return peers, retired
