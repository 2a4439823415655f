"""The weights cache (pure logic): a model directory's content digest, sizes as people write
them, the ledger's wire types (and ``xhpc cache pull``'s), and which node-local copies ``xhpc
cache rm`` and ``xhpc cache prune`` remove.

A weights directory's digest is sha256 over its regular files in the order of their relative
paths (POSIX spelling, compared as strings), each contributing one line
``<relative path>\\0<size>\\0<sha256 of the file>\\n``. It names the content, not where it is or
its files' times: the shared copy and every node-local copy of one model have the same digest,
and a copy cut short or altered has another. A directory that holds a symlink, a device or a
FIFO has no digest (:class:`WeightsError`): a copy is made of regular files only, so nothing it
holds can point outside it.

The broker computes a shared model's digest once and keeps it in its ledger; a job's agent
computes a staged copy's digest once, after copying, and checks it against the shared one.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from pydantic import Field, field_validator

from xhpc.errors import ValidationError, XhpcError
from xhpc.models import Frozen, StagedCopy, check_name

__all__ = [
    "CacheCopy",
    "CacheOutcome",
    "CachePrune",
    "CachePull",
    "CacheRemove",
    "FileEntry",
    "PullResult",
    "PullStatus",
    "PullView",
    "StagedCopy",  # defined with the agent's report (xhpc.models); re-exported
    "WeightsError",
    "digest_of",
    "file_entries",
    "format_size",
    "hub_source",
    "live_users",
    "parse_size",
    "prune_plan",
    "refuse_in_use",
    "tree_digest",
]

CHUNK = 4 * 1024 * 1024  # bytes read at a time when hashing a file


class WeightsError(XhpcError):
    """A weights directory that cannot be digested or staged (a symlink, a special file, gone)."""

    code = "weights_error"


class FileEntry(Frozen):
    """One regular file of a weights directory: its path under the directory, size, sha256."""

    path: str
    size: int = Field(ge=0)
    sha256: str


def digest_of(entries: Iterable[FileEntry]) -> str:
    """The content digest of a directory with these files (``sha256:<hex>``); the order the
    entries come in does not matter."""
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        h.update(f"{e.path}\0{e.size}\0{e.sha256}\n".encode())
    return f"sha256:{h.hexdigest()}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[tuple[str, Path, int]]:
    """Every regular file under ``root``: (relative path, path, size), without reading one;
    WeightsError on a symlink or a special file (or when ``root`` is no directory)."""
    try:
        top = os.lstat(root)
    except OSError as err:
        raise WeightsError(f"weights directory {root} cannot be read: {err.strerror}") from err
    if not stat.S_ISDIR(top.st_mode):
        raise WeightsError(f"weights path {root} is not a directory (symlinks are refused)")
    found: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for name in [*dirnames, *filenames]:
            mode = os.lstat(here / name).st_mode
            rel = (here / name).relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                raise WeightsError(f"weights directory {root} holds a symlink: {rel}")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise WeightsError(f"weights directory {root} holds a special file: {rel}")
        for name in filenames:
            path = here / name
            found.append((path.relative_to(root).as_posix(), path, os.lstat(path).st_size))
    return found


def check_tree(root: Path) -> int:
    """Refuse what ``file_entries`` refuses, reading no file (a copy from a slow shared
    filesystem reads it once, not twice); the files' size in bytes."""
    return sum(size for _, _, size in _files(root))


def file_entries(root: Path) -> list[FileEntry]:
    """Every regular file under ``root``, hashed; WeightsError on a symlink or a special file
    (or when ``root`` is no directory)."""
    return [
        FileEntry(path=rel, size=size, sha256=file_sha256(path)) for rel, path, size in _files(root)
    ]


def tree_digest(root: Path) -> tuple[str, int]:
    """``root``'s content digest and its files' size in bytes."""
    entries = file_entries(root)
    return digest_of(entries), sum(e.size for e in entries)


# -- sizes ------------------------------------------------------------------------------------
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``500M``, ``20G``, ``1.5T``, ``2GiB`` or a plain number of bytes (powers of
    1024); ValidationError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValidationError(f"invalid size {text!r}: use a number with K, M, G or T (e.g. 20G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# -- the ledger's wire types ------------------------------------------------------------------
class CacheCopy(Frozen):
    """One copy of a model's weights: the shared store's (``node`` None) or a node-local one."""

    model: str
    node: str | None = None
    path: str
    size_bytes: int = Field(ge=0)
    digest: str
    last_used_at: datetime | None = None
    users: tuple[str, ...] = ()  # replicas that staged or load it (ever; the live ones block rm)
    in_use_by: tuple[str, ...] = ()  # of those, the replicas alive now

    @property
    def where(self) -> str:
        return self.node or "shared"


class CacheRemove(Frozen):
    """``xhpc cache rm MODEL [--node N]``: node-local copies of ``model`` (on ``node`` only)."""

    model: str = Field(min_length=1, max_length=200)
    node: str | None = Field(default=None, min_length=1, max_length=200)
    dry_run: bool = False


class CachePrune(Frozen):
    """``xhpc cache prune --budget SIZE [--node N]``: each node's copies under the budget."""

    budget_bytes: int = Field(ge=0)
    node: str | None = Field(default=None, min_length=1, max_length=200)
    dry_run: bool = False


class CacheOutcome(Frozen):
    """What a removal did (or, dry, would do): the copies removed and those it left, and why."""

    removed: tuple[CacheCopy, ...] = ()
    kept: tuple[str, ...] = ()  # one line per copy left over a budget, and why
    dry_run: bool = False


# -- pulls into the shared store -------------------------------------------------------------
HUB_MESSAGE = (
    "{source!r} names a model hub, and this site pulls offline only: copy the weights to a "
    "directory on the login node and pass that directory to --from"
)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def hub_source(text: str, *, exists: bool = False) -> bool:
    """Whether ``--from`` names a model hub rather than a directory: a URL (``hf://org/m``,
    ``https://...``), ``hf:org/m``, or ``org/m`` when no such path ``exists``."""
    if "://" in text or text.lower().startswith("hf:"):
        return True
    return not exists and _HUB_ID.fullmatch(text) is not None


class CachePull(Frozen):
    """``xhpc cache pull MODEL --from DIR [--replace]``: DIR copied into the site's shared store
    as ``<models_dir>/<MODEL>`` by a Slurm job (``source``: an absolute path on the login node)."""

    model: str = Field(max_length=63)
    source: str = Field(min_length=1, max_length=4096)
    replace: bool = False

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        return check_name(value, "model name")

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if hub_source(value, exists=True):
            raise ValueError(HUB_MESSAGE.format(source=value))
        if not value.isprintable() or not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path without control characters")
        return value


class PullStatus(StrEnum):
    SUBMITTED = "submitted"  # the job is queued or copying
    DONE = "done"  # the copy is in place and in the ledger
    FAILED = "failed"  # nothing was replaced; ``error`` says why


class PullResult(Frozen):
    """What a pull job reports in its result file: the copy in place (its path, size and
    digest), or why there is none."""

    model: str = Field(max_length=63)
    path: str = Field(max_length=4096)
    size_bytes: int = Field(default=0, ge=0)
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    unchanged: bool = False  # the store held this content already: nothing was copied
    replaced: bool = False  # a different copy was there (--replace) and is gone
    error: str | None = Field(default=None, max_length=2000)


class PullView(Frozen):
    """One pull as the broker keeps it: its job, and once the job reported, the copy recorded
    in the ledger or the error."""

    id: str
    model: str
    source: str
    path: str  # where the copy goes: <models_dir>/<model>
    replace: bool = False
    job_id: str
    status: PullStatus = PullStatus.SUBMITTED
    submitted_at: datetime
    ended_at: datetime | None = None
    recorded: CacheCopy | None = None
    unchanged: bool = False
    replaced: bool = False
    error: str | None = None
    output: str  # the job's output file (%j: its job id)


# -- which copies go --------------------------------------------------------------------------
def refuse_in_use(copies: Sequence[CacheCopy]) -> None:
    """ValidationError naming the first copy a live replica uses."""
    for c in copies:
        if c.in_use_by:
            raise ValidationError(
                f"{c.model} on {c.where} is in use by {', '.join(c.in_use_by)}; "
                "stop those replicas first"
            )


def prune_plan(
    copies: Sequence[CacheCopy], budget_bytes: int, node: str | None = None
) -> tuple[list[CacheCopy], list[str]]:
    """The node-local copies to remove so that each node (``node`` only, if given) holds at most
    ``budget_bytes``: least recently used first (never used: oldest first, then by name), never
    a copy a live replica uses. Also one line per node still over the budget, and why."""
    removed: list[CacheCopy] = []
    kept: list[str] = []
    nodes = sorted({c.node for c in copies if c.node is not None and node in (None, c.node)})
    for n in nodes:
        here = [c for c in copies if c.node == n]
        total = sum(c.size_bytes for c in here)
        order = sorted(here, key=_lru_key)
        for c in order:
            if total <= budget_bytes:
                break
            if c.in_use_by:
                continue
            removed.append(c)
            total -= c.size_bytes
        if total > budget_bytes:
            busy = [c.model for c in order if c.in_use_by]
            kept.append(
                f"{n}: {format_size(total)} left over the budget of {format_size(budget_bytes)}: "
                f"in use ({', '.join(busy)})"
            )
    return removed, kept


def _lru_key(c: CacheCopy) -> tuple[bool, float, str]:
    used = c.last_used_at.timestamp() if c.last_used_at is not None else 0.0
    return (c.last_used_at is not None, used, c.model)


def live_users(users: Iterable[str], alive: Collection[str]) -> tuple[str, ...]:
    return tuple(sorted(u for u in set(users) if u in alive))
