"""Opening the state's database: SQLite at a path (owner-only files, WAL) or PostgreSQL at a
URL (through psycopg, times in UTC, a transaction left idle ended by the server), and the error
of a database that a newer xhpc wrote."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import create_engine

from xhpc.errors import ValidationError, XhpcError


class SchemaTooNewError(XhpcError):
    """The database was written by a newer xhpc: this one would misread or damage it."""

    code = "schema_too_new"

    def __init__(self, db_path: Path | str, found: int, known: int) -> None:
        self.db_path = db_path
        self.found = found
        self.known = known
        super().__init__(
            f"the state database {db_path} has schema version {found}; this xhpc knows "
            f"versions up to {known} and will not use it",
            hint="run the newer xhpc that wrote it, or set db_path/state_dir to another database",
        )


# SQLite's own files next to the database; it creates them with the database file's mode.
_SIDE_FILES = ("-wal", "-shm", "-journal")


def open_owner_only(db_path: Path) -> None:
    """Make the database file owner-only before SQLite first opens it (it holds engine secrets
    and key digests): SQLite then creates its -wal and -shm files with that same mode, so no
    file of the database is ever readable by others, not even for a moment. Files an earlier
    version left with a wider mode are narrowed too."""
    db_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in _SIDE_FILES:
        try:
            os.chmod(f"{db_path}{suffix}", 0o600)
        except FileNotFoundError:
            continue


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


IDLE_TX_MS = 5000  # a server database ends a transaction idle this long (a frozen broker's)


def server_url(url: str) -> str:
    """A server database's URL as SQLAlchemy takes it: PostgreSQL through psycopg."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgresql+psycopg", "postgres"):
        raise ValidationError(
            f"db_url must be a PostgreSQL URL (postgresql://USER@HOST/DB), not {scheme!r}"
        )
    return f"postgresql+psycopg://{rest}"


def open_engine(db: Path | str) -> Engine:
    """An engine on SQLite (a path) or PostgreSQL (a URL)."""
    if isinstance(db, str):
        # Times are stored as UTC without a zone, as SQLite has them. A transaction left open
        # by a broker frozen in it (its locks would hold a standby back) is ended by the server.
        options = f"-c timezone=UTC -c idle_in_transaction_session_timeout={IDLE_TX_MS}"
        try:
            return create_engine(
                server_url(db), pool_pre_ping=True, connect_args={"options": options}
            )
        except ModuleNotFoundError as err:
            raise XhpcError(
                f"db_url needs PostgreSQL's driver, which is not installed ({err.name})",
                hint="install xhpc with its postgres extra: pip install 'xhpc-serve[postgres]'",
            ) from err
    # Engine secrets live here: owner-only from creation (SQLite gives -wal/-shm its mode).
    open_owner_only(db)
    engine = create_engine(f"sqlite:///{db}", connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _on_connect)
    return engine
