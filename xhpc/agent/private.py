"""Places on a compute node that are ours alone: the directories and files xhpc makes there.

Compute nodes are shared by lab members who do not trust one another, and what xhpc keeps on a
node sits under a base others may write too (the site's ``[cache] local_dir``, the job's
``TMPDIR``, ``/tmp``). Whoever makes a path first owns it: a directory another user made at a
name we chose could hold weights, modules or claims of theirs. So every such place is made or
checked here, and what fails a check is refused with :class:`~xhpc.errors.UnsafePathError`
naming the path, the owner uid found and the mode: never used, never removed (it may be
another user's).

- :func:`shared_base`: the base, and each directory above it, is a directory owned by root or
  by us, and where others may write it, sticky (as ``/tmp`` is), so that nobody else can
  rename or remove what we make in it. The base may be a symlink (the site's or the job's
  choice) when the link is root's or ours; it is made (0700) when absent.
- :func:`private_dir`: one directory directly in a checked parent, made 0700 when absent
  (``fchmod`` on its fd: no umask surprise), then opened with ``O_NOFOLLOW | O_DIRECTORY``
  and checked by ``fstat`` on that fd: a real directory, owned by our effective uid, and
  writable by nobody else (``strict``: no group or other access at all).
- :func:`owned_entry`: what lies at a path in a private directory, refused when it is not ours.
- :func:`scratch_dir`: a fresh directory with an unguessable name under a checked base.
- :func:`open_private`: a file in such a directory (a lock, a claim), opened with
  ``O_NOFOLLOW`` and checked on its fd: a regular file of ours that nobody else may write.

Once a directory has passed, paths under it may be used by name: nobody else can write in
it, and nobody else can rename it out of its sticky (or private) parent.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from xhpc.errors import UnsafePathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a file should be is refused, not waited on.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _refuse(path: Path, why: str, st: os.stat_result | None) -> UnsafePathError:
    if st is None:
        return UnsafePathError(f"{path} {why}: refused", path=path, owner_uid=None, mode=None)
    found = f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
    return UnsafePathError(
        f"{path} {why} ({found}): refused", path=path, owner_uid=st.st_uid, mode=st.st_mode
    )


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _check_ancestor(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory", st)
    if st.st_uid not in (0, os.geteuid()):
        raise _refuse(path, "belongs to another user, who could replace what we make in it", st)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, "may be written by others and is not sticky", st)


def shared_base(path: Path, *, create: bool = True) -> Path:
    """``path`` (made 0700 when absent and ``create``) once it and each directory above it,
    as named and as resolved, are directories owned by root or us, sticky where others may
    write them (a symlink on the way must be root's or ours)."""
    if create and not os.path.lexists(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
    absolute = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for p in (absolute, *absolute.parents, real, *real.parents):
        try:
            st = os.lstat(p)
        except OSError as err:
            raise _refuse(p, f"cannot be read ({err.strerror})", None) from err
        if not stat.S_ISLNK(st.st_mode):
            _check_ancestor(p, st)
        elif st.st_uid not in (0, os.geteuid()):
            raise _refuse(p, "is a symlink of another user, who could point it elsewhere", st)
    return path


def private_dir(path: Path, *, strict: bool = True) -> Path:
    """``path``, a directory of ours in a checked parent: made 0700 when absent, then refused
    unless it is a real directory (not a symlink) owned by us that nobody else may write
    (``strict``: nobody else may even read or enter it)."""
    try:
        os.mkdir(path, 0o700)
        made = True
    except FileExistsError:
        made = False
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as err:
        st = _lstat(path)
        link = st is not None and stat.S_ISLNK(st.st_mode)
        why = "is a symlink" if link else "is not a directory we can open"
        raise _refuse(path, why, st) from err
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _refuse(path, "belongs to another user", st)
        if made:
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        if st.st_mode & (0o077 if strict else 0o022):
            who = "group or others may use it" if strict else "group or others may write it"
            raise _refuse(path, who, st)
    finally:
        os.close(fd)
    return path


def owned_entry(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` (None when absent); refused when it is another user's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if st.st_uid != os.geteuid():
        raise _refuse(path, "belongs to another user", st)
    return st


def scratch_dir(base: Path, prefix: str) -> Path:
    """A fresh private directory (0700, an unguessable name) under the checked ``base``."""
    shared_base(base, create=False)
    return private_dir(Path(tempfile.mkdtemp(prefix=prefix, dir=base)))


def open_private(path: Path, flags: int, *, owned: bool = True) -> int:
    """An fd on the regular file ``path`` (created 0600 with ``os.O_CREAT`` in ``flags``),
    never through a symlink; ``owned``: it must be ours, and nobody else may write it."""
    try:
        fd = os.open(path, flags | _FILE_FLAGS, 0o600)
    except OSError as err:
        st = _lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "is not a regular file", st) from err
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "is not a regular file", st)
        if owned and st.st_uid != os.geteuid():
            raise _refuse(path, "belongs to another user", st)
        if owned and st.st_mode & 0o022:
            raise _refuse(path, "may be written by group or others", st)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    if not flags & os.O_NONBLOCK:
        os.set_blocking(fd, True)  # a lock is waited on as the caller asked
    return fd
