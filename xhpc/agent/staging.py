"""Node-local weights: a job stages its model from the shared store to the node's local disk
before its engine starts, and a short job removes copies (``python -m xhpc.agent.staging evict
LOCAL_DIR MODEL...``) or fills the shared store (``pull``: ``xhpc.agent.pull``).

Layout, under the site's ``[cache] local_dir`` on each node: ``<local_dir>/<user>/`` holds
``<model>/`` (the copy), ``.<model>.digest`` (the digest of the shared copy it was made from,
``xhpc.weights``, written once the copy is in place) and ``.<model>.lock`` (the lock every
stager and remover of that model on this node holds while it works). The node is shared with
other users: ``<local_dir>`` must be root's or ours and sticky where others may write it,
``<user>/`` a real directory of ours that nobody else may use, and each copy, lock and record
in it ours (``xhpc.agent.private``); anything else is refused (UnsafePathError), never used and
never removed, and the engine then loads the shared copy.

A stager takes the lock (waiting while another replica stages the same model), then reuses a
copy whose content digest (computed again) equals the digest the broker's ledger holds for the
shared copy (``expected``, from the agent's spec). Without a ledger digest (the model's first
use) the copy must match the record this user wrote when staging it. Otherwise it copies the
shared directory to a private temporary directory beside the target, computing the shared
copy's digest from the bytes as they are read (the shared store is read once), refuses a copy
whose content is not ``expected`` (or not what was read), and renames it into place: a copy is
either whole or absent. On first use the digest as read is reported to the broker, which keeps
it as the shared copy's: the trust is in the shared store, which the site's admins write and
which the engine would load anyway. Symlinks and special files are never copied or followed;
nothing outside ``<local_dir>/<user>/`` is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from xhpc.agent.private import open_private, owned_entry, private_dir, shared_base
from xhpc.errors import UnsafePathError
from xhpc.models import NAME_RE, StagedCopy
from xhpc.weights import CHUNK, FileEntry, WeightsError, check_tree, digest_of, tree_digest

log = logging.getLogger(__name__)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def user_dir(local_dir: Path, user: str | None = None) -> Path:
    """This user's part of the node's cache: made owner-only, or refused (UnsafePathError) when
    it is not a private directory of ours (another user's, a symlink, open to others)."""
    name = user or getpass.getuser()
    if not name or "/" in name or name.startswith("."):
        raise WeightsError(f"invalid user name {name!r} for the weights cache")
    shared_base(local_dir)
    return private_dir(local_dir / name)


def _check_name(model: str) -> None:
    if not NAME_RE.fullmatch(model):
        raise WeightsError(f"invalid model name {model!r} for the weights cache")


@contextlib.contextmanager
def model_lock(base: Path, model: str, *, owned: bool = True) -> Iterator[None]:
    """Hold ``.<model>.lock`` exclusively (blocks while another process holds it): a regular
    file, never reached through a symlink; ``owned`` (a private directory): ours."""
    fd = open_private(base / f".{model}.lock", os.O_RDWR | os.O_CREAT, owned=owned)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_tree(base: Path, path: Path) -> None:
    """Remove ``path`` (an entry of ours directly in ``base``; a directory's symlinks are
    removed, not followed); another user's is refused (UnsafePathError), never removed."""
    if path.parent != base:
        raise WeightsError(f"refusing to remove {path}: not directly in {base}")
    st = owned_entry(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # does not follow symlinks inside
    else:
        path.unlink()  # a symlink or a file where a copy should be: the link itself goes


def _read_digest(base: Path, model: str) -> str | None:
    """The digest this user recorded for its copy (a file of ours, never through a link)."""
    try:
        fd = open_private(base / f".{model}.digest", os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as fh:
        text = fh.read(100).strip()
    return text if DIGEST.fullmatch(text) else None


def _write_digest(base: Path, model: str, digest: str) -> None:
    fd = open_private(base / f".{model}.digest", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as fh:
        fh.write(digest + "\n")


def _forget(base: Path, model: str) -> bool:
    """Remove the record and the copy of ``model``; whether there was a copy."""
    record = base / f".{model}.digest"
    if owned_entry(record) is not None:
        record.unlink()
    there = os.path.lexists(base / model)
    _remove_tree(base, base / model)
    return there


class _HashingCopy:
    """``shutil.copytree``'s copy function: copies a regular file (never through a link, never
    a special file) and keeps its entry of the source's digest, from the bytes it read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: list[FileEntry] = []

    def __call__(self, src: str, dst: str) -> str:
        rel = Path(src).relative_to(self.root).as_posix()
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with os.fdopen(os.open(src, flags), "rb") as fin:
            mode = os.fstat(fin.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise WeightsError(f"weights directory {self.root} holds a special file: {rel}")
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            h, size = hashlib.sha256(), 0
            with os.fdopen(out, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    h.update(chunk)
                    fout.write(chunk)
                    size += len(chunk)
                os.fchmod(fout.fileno(), stat.S_IMODE(mode) & 0o755)
        self.entries.append(FileEntry(path=rel, size=size, sha256=h.hexdigest()))
        return dst

    def digest(self) -> tuple[str, int]:
        return digest_of(self.entries), sum(e.size for e in self.entries)


def _reusable(base: Path, model: str, expected: str | None) -> StagedCopy | None:
    """The copy of ``model`` already here, if it is ours and holds ``expected`` (without it:
    what this user's record says); None when it must be staged again."""
    target = base / model
    st = owned_entry(target)  # another user's is refused, never used nor removed
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None  # absent, or a link or file of ours where the copy should be: replaced
    if st.st_mode & 0o022:
        log.warning("local copy of %s may be written by others: staging it again", model)
        return None
    want = expected or _read_digest(base, model)
    if want is None:
        return None
    try:
        digest, size = tree_digest(target)
    except WeightsError as err:
        log.warning("local copy of %s unusable (%s): staging it again", model, err)
        return None
    if digest != want:
        what = "the ledger's digest of the shared copy" if expected else "its record"
        log.warning("local copy of %s does not match %s: staging it again", model, what)
        return None
    return StagedCopy(model=model, path=str(target), size_bytes=size, digest=digest, reused=True)


def _copy(source: Path, base: Path, model: str, expected: str | None) -> tuple[str, int]:
    """Copy ``source`` to ``base/model`` through a private temporary directory; the digest
    (of the shared copy as read, and of the copy as written: they must agree, and equal
    ``expected`` when given) and size."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{model}.tmp-", dir=base))
    try:
        copied = tmp / "w"
        hashing = _HashingCopy(source)
        shutil.copytree(source, copied, symlinks=True, copy_function=hashing)
        read, size = hashing.digest()
        if expected is not None and read != expected:
            raise WeightsError(
                f"the shared copy {source} does not match the ledger's digest of it "
                f"({read}, not {expected}): not staged"
            )
        if tree_digest(copied)[0] != read:  # also refuses a symlink that appeared meanwhile
            raise WeightsError(f"the copy of {source} differs from what was read: not staged")
        for dirpath, _, _ in os.walk(copied):  # regular directories only (checked above)
            os.chmod(dirpath, stat.S_IMODE(os.lstat(dirpath).st_mode) & 0o755)
        os.rename(copied, base / model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return read, size


def stage(
    source: Path,
    local_dir: Path,
    model: str,
    *,
    user: str | None = None,
    expected: str | None = None,
) -> StagedCopy:
    """A checked local copy of ``source`` (``model``'s shared weights) under ``local_dir``.
    ``expected``: the ledger's digest of ``source``; no copy with other content is returned."""
    _check_name(model)
    if expected is not None and not DIGEST.fullmatch(expected):
        raise WeightsError(f"invalid expected digest {expected!r}")
    base = user_dir(local_dir, user)
    with model_lock(base, model):
        found = _reusable(base, model, expected)
        if found is not None:
            return found
        check_tree(source)  # refuses symlinks or special files before copying, reading nothing
        _forget(base, model)
        digest, size = _copy(source, base, model, expected)
        _write_digest(base, model, digest)
        return StagedCopy(
            model=model, path=str(base / model), size_bytes=size, digest=digest, source=str(source)
        )


def evict(local_dir: Path, models: Sequence[str], *, user: str | None = None) -> list[str]:
    """Remove these models' local copies (each under its lock); the names removed."""
    base = user_dir(local_dir, user)
    removed: list[str] = []
    for model in models:
        _check_name(model)
        with model_lock(base, model):
            if _forget(base, model):
                removed.append(model)
    return removed


def main(argv: Sequence[str]) -> int:
    """``evict LOCAL_DIR MODEL...`` or ``pull SOURCE MODELS_DIR MODEL RESULT [--replace]``
    (``xhpc.agent.pull``): what a cache job runs."""
    if len(argv) > 0 and argv[0] == "pull":
        from xhpc.agent.pull import main as pull_main  # it builds on this module's lock

        return pull_main(argv[1:])
    if len(argv) < 2 or argv[0] != "evict":
        print("usage: python -m xhpc.agent.staging evict LOCAL_DIR MODEL...", file=sys.stderr)
        print(
            "       python -m xhpc.agent.staging pull SOURCE MODELS_DIR MODEL RESULT",
            file=sys.stderr,
        )
        return 2
    try:
        removed = evict(Path(argv[1]), argv[2:])
    except (WeightsError, UnsafePathError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"removed: {' '.join(removed) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
