"""A broker's state as one file, and back (`xhpc state backup | restore`).

A backup is a tar archive of three members: ``manifest.json`` (the format, the xhpc version and
schema version that made it, when, the broker id, what it holds), ``xhpc.db`` (a consistent
snapshot of the database, taken with SQLite's online backup while the broker runs: it copies the
pages of one read transaction, WAL included) and ``broker-id`` (it tags the broker's jobs: a
broker restored with it adopts its running jobs by their tags instead of cancelling them as
strangers'). The archive holds engine secrets and key digests: it is written owner-only and
never over an existing file.

A state in PostgreSQL is backed up the same way: its rows are copied, in one snapshot, into the
backup's SQLite file (``xhpc.store.copy``); a restore into PostgreSQL copies them back into a
database that holds no rows yet. One format for both backends: a state moves between them
through a backup.

A restore writes the database and the broker id into a state directory that holds no state yet
(no database with tables, no other broker id) and that no broker runs on; it reads the archive
member by member (never extracting paths from it), checks that the database is whole and not
from a newer xhpc, and brings its schema forward, as a broker's start would.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import sqlite3
import tarfile
import tempfile
import time
from datetime import datetime
from pathlib import Path

from pydantic import Field
from pydantic import ValidationError as PydanticValidationError

from xhpc.clock import utcnow
from xhpc.errors import ValidationError
from xhpc.models import Frozen
from xhpc.store.copy import copy_state, rows_in, schema_of
from xhpc.store.engine import open_engine
from xhpc.store.tables import SCHEMA_VERSION

FORMAT = 1
MANIFEST = "manifest.json"
DATABASE = "xhpc.db"
BROKER_ID = "broker-id"
MEMBERS = (MANIFEST, DATABASE, BROKER_ID)
MAX_SMALL = 64 * 1024  # the manifest and the broker id


class BackupManifest(Frozen):
    format: int = Field(ge=1)
    xhpc_version: str
    schema_version: int = Field(ge=0)
    made_at: datetime
    broker_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    deployments: int = Field(ge=0)  # live ones (not stopped)
    replicas: int = Field(ge=0)  # active ones
    db_bytes: int = Field(ge=0)


def _counts(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """(schema version, live deployments, active replicas) of a database."""
    version = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0
    deps = conn.execute("SELECT COUNT(*) FROM deployments WHERE stopped_at IS NULL").fetchone()[0]
    reps = conn.execute(
        "SELECT COUNT(*) FROM replicas WHERE state NOT IN ('STOPPED', 'FAILED', 'LOST')"
    ).fetchone()[0]
    return int(version), int(deps), int(reps)


def _snapshot_server(url: str, snap: Path) -> None:
    """The PostgreSQL state at ``url``, copied in one snapshot into a new SQLite file ``snap``."""
    from xhpc.store.store import Store

    source = open_engine(url)
    try:
        found = schema_of(source)
        if found == 0:
            raise ValidationError("the state database holds no state", hint="has a broker run?")
        if found != SCHEMA_VERSION:
            raise ValidationError(
                f"the state database is at schema version {found}, this xhpc's is {SCHEMA_VERSION}",
                hint="back it up with the xhpc version whose broker runs on it",
            )
        into = Store(snap)
        try:
            copy_state(source, into.engine)
        finally:
            into.engine.dispose()
    finally:
        source.dispose()


def backup(db: Path | str, state_dir: Path, out: Path, xhpc_version: str) -> BackupManifest:
    """Write a consistent snapshot of the state (``db``: SQLite's path, or a PostgreSQL URL) to
    ``out`` (a new file, owner-only); ``xhpc_version``: the version that makes it, for the
    manifest."""
    if isinstance(db, Path) and not db.is_file():
        raise ValidationError(f"no state database at {db}", hint="has a broker run here?")
    id_file = state_dir / BROKER_ID
    try:
        broker_id = id_file.read_text().strip()
    except OSError as err:
        raise ValidationError(f"no broker id at {id_file}: {err.strerror}") from err
    out = out.absolute()
    if out.exists() or out.is_symlink():
        raise ValidationError(f"{out} exists; a backup never overwrites a file")
    with tempfile.TemporaryDirectory(prefix=".xhpc-backup.", dir=out.parent) as work:
        snap = Path(work) / DATABASE
        if isinstance(db, str):
            _snapshot_server(db, snap)
        try:
            with contextlib.closing(sqlite3.connect(snap)) as dst:
                if isinstance(db, Path):
                    with contextlib.closing(sqlite3.connect(db)) as src:
                        src.backup(dst)  # one read transaction's pages: consistent while it runs
                dst.execute("PRAGMA journal_mode=DELETE")  # one file, no -wal beside it
                version, deps, reps = _counts(dst)
        except sqlite3.DatabaseError as err:
            raise ValidationError(f"{db} is not an xhpc state database: {err}") from err
        manifest = BackupManifest(
            format=FORMAT,
            xhpc_version=xhpc_version,
            schema_version=version,
            made_at=utcnow(),
            broker_id=broker_id,
            deployments=deps,
            replicas=reps,
            db_bytes=snap.stat().st_size,
        )
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            _add(tar, MANIFEST, manifest.model_dump_json(indent=2).encode())
            _add(tar, BROKER_ID, f"{broker_id}\n".encode())
            info = tar.gettarinfo(str(snap), arcname=DATABASE)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o600
            with snap.open("rb") as f:
                tar.addfile(info, f)
    return manifest


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def read_manifest(archive: Path) -> BackupManifest:
    """The archive's manifest, checked (the archive itself is read, not trusted)."""
    with _open(archive) as tar:
        return _manifest(tar)


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, mode="r:gz")
    except (OSError, tarfile.TarError) as err:
        raise ValidationError(f"{archive} is not an xhpc state backup: {err}") from err


def _member(tar: tarfile.TarFile, name: str, limit: int | None) -> tarfile.TarInfo:
    found = [m for m in tar.getmembers() if m.name == name]
    if len(found) != 1 or not found[0].isfile():
        raise ValidationError(f"the backup has no single file {name!r}")
    if limit is not None and found[0].size > limit:
        raise ValidationError(f"the backup's {name!r} is too large ({found[0].size} bytes)")
    return found[0]


def _read(tar: tarfile.TarFile, name: str, limit: int) -> bytes:
    member = _member(tar, name, limit)
    f = tar.extractfile(member)
    assert f is not None  # a regular file
    return f.read(limit + 1)


def _manifest(tar: tarfile.TarFile) -> BackupManifest:
    extra = sorted({m.name for m in tar.getmembers()} - set(MEMBERS))
    if extra:
        raise ValidationError(f"the backup holds what no xhpc backup holds: {extra[:5]}")
    try:
        manifest = BackupManifest.model_validate_json(_read(tar, MANIFEST, MAX_SMALL))
    except PydanticValidationError as err:
        raise ValidationError(
            f"the backup's manifest is not valid: {err.errors()[0]['msg']}"
        ) from err
    if manifest.format != FORMAT:
        raise ValidationError(f"backup format {manifest.format}; this xhpc reads {FORMAT}")
    if manifest.schema_version > SCHEMA_VERSION:
        raise ValidationError(
            f"the backup is of schema version {manifest.schema_version}, newer than this xhpc's "
            f"{SCHEMA_VERSION} (made by xhpc {manifest.xhpc_version})",
            hint="restore it with that version of xhpc or a later one",
        )
    return manifest


def _broker_running(state_dir: Path) -> bool:
    lock = state_dir / "broker.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this call took
    return False


def _holds_state(db: Path | str) -> bool:
    if isinstance(db, str):
        engine = open_engine(db)
        try:
            return rows_in(engine) > 0
        finally:
            engine.dispose()
    if not db.exists():
        return False
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return bool(
            conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE type='table'").fetchone()[0]
        )


def restore(archive: Path, db: Path | str, state_dir: Path) -> BackupManifest:
    """Write the backup's database and broker id into a state directory with no state yet
    (``db``: SQLite's path, or a PostgreSQL URL whose database holds no rows)."""
    if _broker_running(state_dir):
        raise ValidationError(f"a broker runs on {state_dir}: stop it first")
    if _holds_state(db):
        where = "the state database" if isinstance(db, str) else str(db)
        raise ValidationError(
            f"{where} already holds a state; a restore writes only into a fresh one",
            hint="move it aside (it is yours to keep or delete) and restore again",
        )
    db_path = state_dir / f".restore-{os.getpid()}.db" if isinstance(db, str) else db
    id_file = state_dir / BROKER_ID
    with _open(archive) as tar:
        manifest = _manifest(tar)
        if id_file.exists() and id_file.read_text().strip() != manifest.broker_id:
            raise ValidationError(f"{id_file} names another broker; restore into a fresh state_dir")
        member = _member(tar, DATABASE, None)
        db_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".xhpc-restore.", dir=db_path.parent)
        try:
            src = tar.extractfile(member)
            assert src is not None
            with os.fdopen(fd, "wb") as dst:  # mkstemp: owner-only
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            _check_whole(Path(tmp))
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{db_path}{suffix}").unlink()
            os.replace(tmp, db_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    from xhpc.store.lease import expire_restored
    from xhpc.store.store import Store  # migrations forward, as a broker's start would

    store = Store(db_path)
    try:
        if isinstance(db, str):
            server = Store(db)
            try:
                copy_state(store.engine, server.engine)
                expire_restored(server)
            finally:
                server.engine.dispose()
        else:
            expire_restored(store)
    finally:
        store.engine.dispose()
        if isinstance(db, str):
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{db_path}{suffix}").unlink()
    id_file.write_text(f"{manifest.broker_id}\n")
    return manifest


def _check_whole(path: Path) -> None:
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            verdict = conn.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.DatabaseError as err:
        raise ValidationError(f"the backup's database is not readable: {err}") from err
    if verdict != "ok":
        raise ValidationError(f"the backup's database is damaged: {verdict}")
