"""A read-only FUSE passthrough of a directory whose reads share one bandwidth cap: the "shared
filesystem" of bench/cache.py.

    .venvs/mfusepy/bin/python bench/_throttle.py SOURCE MOUNTPOINT --mb-s 20 [--page-cache]

Its own process, in the foreground; mounted with ``allow_other`` (Slurm jobs of any user see it)
and ``direct_io``: no page cache, so every read of every start pays the cap (``--page-cache``:
without direct_io, for kernels that refuse safetensors' shared mmap of a direct_io file; still
without ``kernel_cache``/``auto_cache``, so the kernel drops a file's cached pages whenever it is
opened again and every start of an engine reads its weights through the cap). Every read, from any
thread, waits for its turn on one ``Pacer``: the mount never delivers more than the cap (in
MB/s, 10^6 bytes). SIGTERM, SIGINT and SIGHUP end it (libfuse's handlers leave its loop and
unmount); on any exit it also runs ``fusermount3 -u`` on the mount point itself.

mfusepy (ctypes bindings for libfuse 3) lives in .venvs/mfusepy and Debian's fuse3 provides
libfuse3 and fusermount3 (scripts/setup-bench). Only ``main`` imports mfusepy: ``Pacer`` and the
helpers for the bench run with any Python.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FUSERMOUNT = "fusermount3"
_STOPPED_BY_SIGNAL = "8"  # what libfuse 3's fuse_main returns when a signal ended its loop


class Pacer:
    """One byte budget shared by every reader: ``take(n)`` returns when the ``n`` bytes fit
    under ``bytes_per_s`` after everything taken before (first come, first served)."""

    def __init__(
        self,
        bytes_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError("the cap must be positive")
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the budget is next free

    def take(self, n: int) -> float:
        """Wait until ``n`` bytes may pass; the seconds waited."""
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            self._free_at = start + n / self.bytes_per_s
            done_at = self._free_at
        wait_s = done_at - now
        if wait_s > 0:
            self._sleep(wait_s)
        return max(0.0, wait_s)


def unmount(mountpoint: Path) -> bool:
    """``fusermount3 -u`` (lazily, ``-z``, when busy); True when nothing is mounted there now."""
    for argv in ([FUSERMOUNT, "-u", str(mountpoint)], [FUSERMOUNT, "-u", "-z", str(mountpoint)]):
        if not os.path.ismount(mountpoint):
            return True
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, capture_output=True, timeout=30, check=False)
    return not os.path.ismount(mountpoint)


def fuse_usable() -> str | None:
    """Why this machine cannot mount the throttle (None: it can try)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([FUSERMOUNT, "-V"], capture_output=True, timeout=10, check=True)
        return None
    return f"no {FUSERMOUNT} (Debian's fuse3: scripts/setup-bench)"


def _operations(source: Path, pacer: Pacer) -> Any:
    import mfusepy as fuse

    class Throttled(fuse.Operations):  # type: ignore[misc]
        use_ns = True

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(self._real(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")
            attrs: dict[str, Any] = {k: getattr(st, k) for k in keys}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._real(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(self._real(path))

        def open(self, path: str, flags: int) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
                raise fuse.FuseOSError(errno.EROFS)
            return os.open(self._real(path), os.O_RDONLY | os.O_NOFOLLOW)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            data = os.pread(fh, size, offset)
            pacer.take(len(data))
            return data

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._real(path))
            keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
            return {k: getattr(sv, k) for k in keys} | {"f_namemax": sv.f_namemax}

    return Throttled()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A read-only passthrough with a read-bandwidth cap.")
    ap.add_argument("source", type=Path)
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--mb-s", type=float, required=True, help="the cap, in MB/s (10^6 bytes)")
    ap.add_argument(
        "--page-cache", action="store_true",
        help="no direct_io (pages cached until the file is opened again)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.mb_s <= 0:
        ap.error("--mb-s must be positive")
    import mfusepy as fuse

    source = args.source.resolve()
    atexit.register(unmount, args.mountpoint)
    options: dict[str, Any] = {"allow_other": True, "ro": True, "fsname": "xhpc-throttle"}
    if not args.page_cache:
        options["direct_io"] = True
    try:
        fuse.FUSE(
            _operations(source, Pacer(args.mb_s * 1e6)),
            str(args.mountpoint),
            foreground=True,
            **options,
        )
    except RuntimeError as err:
        if str(err) != _STOPPED_BY_SIGNAL:
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
