"""The Batch API's files on the gateway (``/v1/files``): each user's uploads, bounded, owner-only.

A user's files are ``<root>/<user>/<id>`` (the content) and ``<id>.json`` (its OpenAI file
object), the root being ``<state_dir>/files``. ``<user>`` is the key's user, a checked name
(``check_name``: it never leaves the root). The root and each user's directory are 0700 and
the proxy's user's own, opened with ``O_NOFOLLOW``: a symlink, or a directory another user
owns, is refused and nothing is written through it. Files are created ``O_EXCL | O_NOFOLLOW``,
0600, and read ``O_NOFOLLOW``.

An upload is streamed (``stage``): its chunks go to a temporary file in the user's directory,
counted (bytes, lines) and cut at the limits, so the gateway never holds a file whole. Then
(``commit``, in a thread: the event loop goes on answering) every line is checked to be a JSON
object, the first bad one named, and under a lock on the user's directory (two workers'
uploads cannot pass the quota together) the count and total are checked again and the file
renamed into place. Anything refused leaves nothing behind.

The limits (``[proxy] files_*``, ``FileLimits``): files per user, their bytes together, one
file's bytes and lines, and age. A file older than ``max_age_s`` is deleted on its user's next
call and by ``sweep`` over every user, which the gateway runs periodically (``install``);
so is a temporary file an upload left (a worker killed mid-upload) after ``STALE_S``.

Refusals, OpenAI-shaped: 413 ``file_too_large``; 400 ``too_many_lines``, ``too_many_files``,
``storage_quota_exceeded``, ``invalid_jsonl`` (the first bad line named), ``invalid_user``
(a key's user that is no name for a directory); 500 ``unsafe_files_dir`` (a user's directory
that is a symlink, not a directory, or not the proxy's user's own: logged, never used).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from aiohttp import web

from xhpc.batch.lines import InputCheck
from xhpc.gateway_settings import ProxyConfig
from xhpc.ids import IdKind, new_file_id, valid
from xhpc.models import check_name
from xhpc.proxy.errors import ProxyHTTPError

log = logging.getLogger(__name__)

TEMP_PREFIX = ".upload-"
STALE_S = 3600.0  # a temporary file older than this was left by an upload that died
WRITE_BYTES = 1 << 20  # an upload's chunks are written in blocks of this, in a thread
MAX_FILENAME_CHARS = 255
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never waits
T = TypeVar("T")


def plain_name(filename: str, default: str = "upload.jsonl") -> str:
    """The name a file is shown by: its last path component, printable characters only, at
    most ``MAX_FILENAME_CHARS`` (it is never a path: files are stored by id)."""
    last = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in last if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF)
    name = name[:MAX_FILENAME_CHARS].strip()
    return default if name in ("", ".", "..") else name


def refused(status: int, message: str, code: str) -> ProxyHTTPError:
    """An upload or a files call refused (OpenAI-shaped; 5xx: the store's own fault)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ProxyHTTPError(status, message, type_=kind, code=code)


@dataclass(frozen=True)
class FileLimits:
    """Per user: files at once, their bytes together, one file's bytes and lines, age; the
    pace of one upload and of batch creation (a tenant's share of the gateway)."""

    max_count: int = 100
    max_bytes: int = 1 << 30
    max_file_bytes: int = 64 << 20
    max_lines: int = 100_000
    max_age_s: float = 7 * 24 * 3600.0
    upload_bytes_per_s: float | None = None  # one upload's pace at most (None: as it comes)
    batches_per_minute: int | None = None  # batches one user may create a minute (per worker)
    calls_per_s: float | None = None  # Files and Batch calls of one user a second (per worker)

    @classmethod
    def of(cls, config: ProxyConfig) -> FileLimits:
        return cls(
            max_count=config.files_max_count,
            max_bytes=config.files_max_bytes,
            max_file_bytes=config.files_max_file_bytes,
            max_lines=config.files_max_lines,
            max_age_s=config.files_max_age_s,
            upload_bytes_per_s=config.files_upload_bytes_per_s,
            batches_per_minute=config.batches_per_minute,
            calls_per_s=config.batch_api_calls_per_s,
        )


@dataclass
class Staged:
    """An upload streamed to its temporary file ``name`` in the user directory ``dir_fd``."""

    dir_fd: int
    name: str
    size: int = 0
    lines: int = 0
    open: bool = True  # the temporary file and the directory's descriptor are still held
    check: InputCheck = field(default_factory=InputCheck)  # its lines, checked as written


async def _waited(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, waited for to its end even when the caller is cancelled
    meanwhile: it uses descriptors the caller closes once it is done."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        raise


def _write_all(fd: int, data: bytearray) -> None:
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])


def _write_checked(fd: int, data: bytearray, check: InputCheck) -> None:
    """``data`` written, and its lines checked (``check``), in one trip to a thread."""
    _write_all(fd, data)
    check.feed(data)


def _unlink(name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def _read(name: str, dir_fd: int) -> bytes | None:
    """The file's bytes; None when it is missing or not a regular file (a symlink)."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read()


def _not_input(problem: str) -> ProxyHTTPError:
    return refused(400, f"the file is not a batch's input: {problem}", "invalid_jsonl")


class FileStore:
    """The users' uploaded files under ``root``, held to ``limits``."""

    def __init__(self, root: Path, limits: FileLimits | None = None) -> None:
        self.root = root
        self.limits = limits or FileLimits()

    # -- directories ------------------------------------------------------------------------
    def _owned(self, fd: int, what: str) -> None:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            log.warning("files: %s is owned by uid %d, not this proxy's user", what, st.st_uid)
            raise refused(500, f"the files directory of {what} is not the proxy's own",
                          "unsafe_files_dir")  # fmt: skip
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # narrowed: a directory made wider by hand or an old version

    def _open_root(self) -> int:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(self.root, _DIR)
        except OSError as err:
            why = "the files directory is not a plain directory"
            raise refused(500, why, "unsafe_files_dir") from err
        try:
            self._owned(fd, "the files root")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_user(self, user: str, create: bool) -> int | None:
        """The user's directory, opened (None when it does not exist and ``create`` is off)."""
        try:
            name = check_name(user, "user")
        except ValueError as err:
            raise refused(400, str(err), "invalid_user") from err
        root = self._open_root()
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=root)
            try:
                fd = os.open(name, _DIR, dir_fd=root)
            except FileNotFoundError:
                return None
            except OSError as err:  # a symlink (ELOOP) or not a directory (ENOTDIR)
                log.warning("files: %s/%s is not a plain directory: %s", self.root, name, err)
                raise refused(500, f"the files directory of {name} is not a plain directory",
                              "unsafe_files_dir") from err  # fmt: skip
        finally:
            os.close(root)
        try:
            self._owned(fd, name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _user_dir(self, user: str, create: bool = False) -> Iterator[int | None]:
        fd = self._open_user(user, create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    # -- reading, expiring ------------------------------------------------------------------
    def _meta(self, dir_fd: int, file_id: str, now: float) -> dict[str, Any] | None:
        """The file object of ``file_id``; an expired file is deleted (None)."""
        raw = _read(f"{file_id}.json", dir_fd)
        try:
            obj = json.loads(raw) if raw is not None else None
        except ValueError:
            obj = None
        created = obj.get("created_at") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(created, int | float):
            return None
        if now - created > self.limits.max_age_s:
            self._remove(dir_fd, file_id)
            return None
        return obj

    def _remove(self, dir_fd: int, file_id: str) -> None:
        _unlink(f"{file_id}.json", dir_fd)  # the object first: no object, no file
        _unlink(file_id, dir_fd)

    def _scan(self, dir_fd: int, now: float) -> list[dict[str, Any]]:
        """The user's live file objects; expired files, and what an upload that died left
        (a temporary file, content with no object), are deleted."""
        names = set(os.listdir(dir_fd))
        live = []
        for name in names:
            if name.endswith(".json") and valid(IdKind.FILE, name[:-5]):
                obj = self._meta(dir_fd, name[:-5], now)
                if obj is not None:
                    live.append(obj)
            elif name.startswith(TEMP_PREFIX) or (
                valid(IdKind.FILE, name) and f"{name}.json" not in names
            ):
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if now - st.st_mtime > STALE_S:
                        _unlink(name, dir_fd)
        return sorted(live, key=lambda o: o["created_at"], reverse=True)

    def meta(self, user: str, file_id: str) -> dict[str, Any] | None:
        if not valid(IdKind.FILE, file_id):
            return None
        with self._user_dir(user) as fd:
            return None if fd is None else self._meta(fd, file_id, time.time())

    def content(self, user: str, file_id: str) -> bytes | None:
        if not valid(IdKind.FILE, file_id):
            return None
        with self._user_dir(user) as fd:
            if fd is None or self._meta(fd, file_id, time.time()) is None:
                return None
            return _read(file_id, fd)

    def open(self, user: str, file_id: str) -> BinaryIO | None:
        """A file's content, open for reading (not a link; in the user's own directory); None:
        the user has no such file."""
        if not valid(IdKind.FILE, file_id):
            return None
        with self._user_dir(user) as fd:
            if fd is None or self._meta(fd, file_id, time.time()) is None:
                return None
            try:
                return os.fdopen(os.open(file_id, _READ, dir_fd=fd), "rb")
            except FileNotFoundError:
                return None

    def all(self, user: str) -> list[dict[str, Any]]:
        with self._user_dir(user) as fd:
            return [] if fd is None else self._scan(fd, time.time())

    def delete(self, user: str, file_id: str) -> bool:
        if not valid(IdKind.FILE, file_id):
            return False
        with self._user_dir(user) as fd:
            if fd is None or self._meta(fd, file_id, time.time()) is None:
                return False
            self._remove(fd, file_id)
            return True

    def sweep(self) -> int:
        """Every user's expired and stale files deleted; returns how many files remain."""
        root = self._open_root()
        try:
            users = [n for n in os.listdir(root) if not n.startswith(".")]
        finally:
            os.close(root)
        kept = 0
        for user in users:
            try:
                with self._user_dir(user) as fd:
                    kept += 0 if fd is None else len(self._scan(fd, time.time()))
            except (ProxyHTTPError, OSError) as err:
                log.warning("files: %s/%s not swept: %s", self.root, user, err)
        return kept

    # -- uploads ----------------------------------------------------------------------------
    def _check_room(self, dir_fd: int, size: int) -> int:
        """The bytes of the user's files, refused when one more of ``size`` would not fit."""
        files = self._scan(dir_fd, time.time())
        used = sum(int(o.get("bytes", 0)) for o in files)
        if len(files) >= self.limits.max_count:
            raise refused(400, f"you have {len(files)} files, the most kept per user; delete "
                          "one first (DELETE /v1/files/ID)", "too_many_files")  # fmt: skip
        if used + size > self.limits.max_bytes:
            raise self._over_quota(used)
        return used

    def _over_quota(self, used: int) -> ProxyHTTPError:
        why = (f"your files would hold more than {self.limits.max_bytes} bytes together "
               f"({used} now); delete some first")  # fmt: skip
        return refused(400, why, "storage_quota_exceeded")

    async def stage(self, user: str, chunks: AsyncIterable[bytes]) -> Staged:
        """``chunks`` streamed to a temporary file in ``user``'s directory, cut at the limits
        (then refused, the file removed). The caller ``commit``s or ``discard``s it."""
        limits = self.limits
        dir_fd = self._open_user(user, True)
        if dir_fd is None:  # removed between its mkdir and its open
            raise refused(500, "the user's files directory went away", "unsafe_files_dir")
        staged = Staged(dir_fd, f"{TEMP_PREFIX}{secrets.token_hex(8)}")
        try:
            room = limits.max_bytes - await _waited(self._check_room, dir_fd, 0)
            fd = os.open(staged.name, _NEW, 0o600, dir_fd=dir_fd)
        except BaseException:
            staged.open = False
            os.close(dir_fd)
            raise
        try:
            buf, last = bytearray(), b"\n"
            async for chunk in chunks:
                staged.size += len(chunk)
                if staged.size > limits.max_file_bytes:
                    raise refused(413, f"the file is larger than the gateway's limit of "
                                  f"{limits.max_file_bytes} bytes", "file_too_large")  # fmt: skip
                if staged.size > room:
                    raise self._over_quota(limits.max_bytes - room)
                staged.lines += chunk.count(b"\n")
                if staged.lines > limits.max_lines:
                    raise self._too_many_lines()
                buf += chunk
                last = chunk[-1:] or last
                if len(buf) >= WRITE_BYTES:
                    await self._write(fd, buf, staged.check)
                    buf.clear()
            await self._write(fd, buf, staged.check)
            if last != b"\n":
                staged.lines += 1
                if staged.lines > limits.max_lines:
                    raise self._too_many_lines()
        except BaseException:
            self.discard(staged)
            raise
        finally:
            os.close(fd)
        return staged

    @staticmethod
    async def _write(fd: int, buf: bytearray, check: InputCheck) -> None:
        """A block of the upload written and checked; refused at its first bad line (the rest
        of the upload is not read)."""
        await _waited(_write_checked, fd, buf, check)
        if check.bad is not None:
            raise _not_input(check.bad)

    def _too_many_lines(self) -> ProxyHTTPError:
        return refused(400, f"the file has more than {self.limits.max_lines} lines, the most "
                       "kept per file", "too_many_lines")  # fmt: skip

    def discard(self, staged: Staged) -> None:
        """The upload's temporary file removed (nothing once it was committed)."""
        if staged.open:
            staged.open = False
            _unlink(staged.name, staged.dir_fd)
            os.close(staged.dir_fd)

    async def commit(self, staged: Staged, filename: str, purpose: str) -> dict[str, Any]:
        """The staged upload (its lines were checked as they were written) moved into place,
        in a thread that owns its descriptors from here (a cancelled caller leaves it to end on
        its own)."""
        staged.open = False
        return await asyncio.to_thread(self._commit_owned, staged, filename, purpose)

    def _commit_owned(self, staged: Staged, filename: str, purpose: str) -> dict[str, Any]:
        try:
            return self._commit(staged, filename, purpose)
        finally:
            _unlink(staged.name, staged.dir_fd)  # nothing once it was moved into place
            os.close(staged.dir_fd)

    def _commit(self, staged: Staged, filename: str, purpose: str) -> dict[str, Any]:
        if staged.size == 0:
            raise refused(400, "the file is empty", "invalid_file")
        problem = staged.check.problem()  # the last line's, or "no requests": the rest is known
        if problem is not None:
            raise _not_input(problem)
        dir_fd = staged.dir_fd
        file_id = new_file_id()
        obj = {"id": file_id, "object": "file", "bytes": staged.size,
               "created_at": int(time.time()), "filename": plain_name(filename),
               "purpose": purpose, "status": "processed"}  # fmt: skip
        meta_tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}.json"
        fcntl.flock(dir_fd, fcntl.LOCK_EX)  # the other workers' uploads wait here
        try:
            self._check_room(dir_fd, staged.size)
            fd = os.open(meta_tmp, _NEW, 0o600, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(obj))
            os.rename(staged.name, file_id, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.rename(meta_tmp, f"{file_id}.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            _unlink(meta_tmp, dir_fd)
            raise
        finally:
            fcntl.flock(dir_fd, fcntl.LOCK_UN)
        return obj

    # -- the sweep --------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        """Sweep every user's files while ``app`` runs: at its start, then each
        ``max_age_s / 10`` (an hour at most)."""
        app.cleanup_ctx.append(self._sweeping)

    async def _sweeping(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._sweep_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _sweep_forever(self) -> None:
        every_s = min(self.limits.max_age_s / 10, 3600.0)
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except (OSError, ProxyHTTPError) as err:
                log.warning("files: the sweep failed: %s", err)
            await asyncio.sleep(every_s)
