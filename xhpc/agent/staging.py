"""Node-local weights: a job stages its model from the shared store to the node's local disk
before its engine starts, and a short job removes copies (``python -m xhpc.agent.staging evict
LOCAL_DIR MODEL...``) or fills the shared store (``pull``: ``xhpc.agent.pull``).

Layout, under the site's ``[cache] local_dir`` on each node: ``<local_dir>/<user>/`` (0700)
holds ``<model>/`` (the copy), ``.<model>.digest`` (its content digest, ``xhpc.weights``,
written once the copy is in place) and ``.<model>.lock`` (the lock every stager and remover of
that model on this node holds while it works). A stager takes the lock (waiting while another
replica stages the same model), then reuses a copy whose digest matches (computed again: a copy
damaged since is staged again), or copies the shared directory to a temporary directory beside
it, digests that, and renames it into place: a copy is either whole or absent. Symlinks and
special files are never copied or followed; nothing outside ``<local_dir>/<user>/`` is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from xhpc.models import NAME_RE, StagedCopy
from xhpc.weights import WeightsError, check_tree, tree_digest

log = logging.getLogger(__name__)


def user_dir(local_dir: Path, user: str | None = None) -> Path:
    """This user's part of the node's cache (made owner-only); WeightsError if it is a symlink."""
    base = local_dir / (user or getpass.getuser())
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    if stat.S_ISLNK(os.lstat(base).st_mode):
        raise WeightsError(f"cache directory {base} is a symlink: refused")
    return base


def _check_name(model: str) -> None:
    if not NAME_RE.fullmatch(model):
        raise WeightsError(f"invalid model name {model!r} for the weights cache")


@contextlib.contextmanager
def model_lock(base: Path, model: str) -> Iterator[None]:
    """Hold ``.<model>.lock`` exclusively (blocks while another process holds it)."""
    fd = os.open(base / f".{model}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_tree(base: Path, path: Path) -> None:
    """Remove ``path`` (a directory directly in ``base``, not a symlink) or a stray file."""
    if path.parent != base:
        raise WeightsError(f"refusing to remove {path}: not directly in {base}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # does not follow symlinks inside
    else:
        path.unlink()  # a symlink or a file where a copy should be: the link itself goes


def _read_digest(base: Path, model: str) -> str | None:
    try:
        return (base / f".{model}.digest").read_text().strip() or None
    except OSError:
        return None


def stage(source: Path, local_dir: Path, model: str, *, user: str | None = None) -> StagedCopy:
    """A checked local copy of ``source`` (``model``'s shared weights) under ``local_dir``."""
    _check_name(model)
    base = user_dir(local_dir, user)
    target = base / model
    with model_lock(base, model):
        known = _read_digest(base, model)
        if known is not None and os.path.lexists(target):
            try:
                digest, size = tree_digest(target)
            except WeightsError as err:
                log.warning("local copy of %s unusable (%s): staging it again", model, err)
            else:
                if digest == known:
                    return StagedCopy(
                        model=model, path=str(target), size_bytes=size, digest=digest, reused=True
                    )
                log.warning("local copy of %s does not match its digest: staging it again", model)
        check_tree(source)  # refuses symlinks or special files before copying, reading nothing
        with contextlib.suppress(FileNotFoundError):
            (base / f".{model}.digest").unlink()
        _remove_tree(base, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model}.tmp-", dir=base))
        try:
            copied = tmp / "w"
            shutil.copytree(source, copied, symlinks=True)
            digest, size = tree_digest(copied)
            os.rename(copied, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        (base / f".{model}.digest").write_text(digest + "\n")
        return StagedCopy(model=model, path=str(target), size_bytes=size, digest=digest)


def evict(local_dir: Path, models: Sequence[str], *, user: str | None = None) -> list[str]:
    """Remove these models' local copies (each under its lock); the names removed."""
    base = user_dir(local_dir, user)
    removed: list[str] = []
    for model in models:
        _check_name(model)
        with model_lock(base, model):
            with contextlib.suppress(FileNotFoundError):
                (base / f".{model}.digest").unlink()
            if os.path.lexists(base / model):
                _remove_tree(base, base / model)
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
    except (WeightsError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"removed: {' '.join(removed) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
