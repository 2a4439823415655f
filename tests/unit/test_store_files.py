"""The state database's files: owner-only from the moment they exist, and a database written
by a newer xhpc is refused rather than used."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from xhpc.errors import XhpcError
from xhpc.store import Store
from xhpc.store.store import SchemaTooNewError
from xhpc.store.tables import SCHEMA_VERSION

pytestmark = pytest.mark.security


@pytest.fixture
def wide_umask() -> Iterator[None]:
    """The usual login umask: files are created readable by everyone unless xhpc says not."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("wide_umask")
def test_the_database_and_its_wal_and_shm_files_are_owner_only_from_creation(
    tmp_path: Path,
) -> None:
    db = tmp_path / "state" / "xhpc.db"
    store = Store(db)
    with store.engine.connect():  # a connection is open: its -wal and -shm files exist
        wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
        assert wal.exists() and shm.exists()
        assert {p.name: _mode(p) for p in (db, wal, shm)} == {
            "xhpc.db": 0o600,
            "xhpc.db-wal": 0o600,
            "xhpc.db-shm": 0o600,
        }
    assert _mode(db.parent) == 0o700
    store.engine.dispose()


@pytest.mark.usefixtures("wide_umask")
def test_files_left_readable_by_an_older_version_are_narrowed(tmp_path: Path) -> None:
    db = tmp_path / "xhpc.db"
    Store(db).engine.dispose()
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        path.touch()
        path.chmod(0o644)
    store = Store(db)
    assert {_mode(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))} == {0o600}
    store.engine.dispose()


def _future_db(db: Path) -> None:
    Store(db).engine.dispose()
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
        conn.execute("CREATE TABLE from_the_future (x INTEGER)")
    conn.close()


def test_a_database_from_a_newer_xhpc_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "xhpc.db"
    _future_db(db)
    with pytest.raises(SchemaTooNewError) as info:
        Store(db)
    err = info.value
    assert isinstance(err, XhpcError)
    assert (err.found, err.known) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
    line = err.one_line()
    assert "\n" not in line
    assert f"schema version {SCHEMA_VERSION + 1}" in line and str(db) in line
    with sqlite3.connect(db) as conn:  # untouched: no migration ran over it
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_version")]
    conn.close()
    assert max(versions) == SCHEMA_VERSION + 1
