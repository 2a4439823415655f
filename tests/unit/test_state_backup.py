"""`xhpc state backup | restore` (xhpc.store.backup): a consistent snapshot of a broker's state
taken while it writes, restored into a fresh state directory with the same deployments and
broker id; every restore that could lose or mix state is refused, and a hostile archive is read,
never extracted."""

from __future__ import annotations

import fcntl
import io
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from tests.postgres import Postgres
from tests.unit import test_broker_service
from tests.unit.test_broker_service import make
from xhpc.changes import DeploymentChange
from xhpc.errors import ValidationError
from xhpc.models import NodeInfo, ServeRequest
from xhpc.store import backup as bk
from xhpc.store.store import Store
from xhpc.store.tables import SCHEMA_VERSION


async def _served(tmp_path: Path, nodes: list[NodeInfo], model_dir: Path) -> Store:
    service, _ = make(tmp_path, nodes)
    await service.serve(ServeRequest(model=str(model_dir), name="m", replicas=2))
    await service.serve(ServeRequest(model=str(model_dir), name="n", replicas=1))
    assert (tmp_path / "state" / "broker-id").is_file()  # made by the service
    return service.store


async def test_a_backup_taken_while_the_broker_writes_restores_the_same_state(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    store = await _served(tmp_path, idle_nodes, model_dir)
    state = tmp_path / "state"
    stop = threading.Event()

    def writes() -> None:  # the broker's own writes go on through the backup
        while not stop.is_set():
            store.update_deployment("n", DeploymentChange(wanted=1))

    writer = threading.Thread(target=writes)
    writer.start()
    try:
        made = bk.backup(store.db_path, state, tmp_path / "b.tar.gz", "0.1.0")
    finally:
        stop.set()
        writer.join()
    assert (made.deployments, made.replicas, made.schema_version) == (2, 3, SCHEMA_VERSION)
    assert made.broker_id == (state / "broker-id").read_text().strip()
    assert (tmp_path / "b.tar.gz").stat().st_mode & 0o777 == 0o600  # secrets inside
    assert bk.read_manifest(tmp_path / "b.tar.gz") == made

    fresh = tmp_path / "fresh"
    got = bk.restore(tmp_path / "b.tar.gz", fresh / "xhpc.db", fresh)
    assert got == made
    assert (fresh / "broker-id").read_text().strip() == made.broker_id  # adopts its jobs
    assert (fresh / "xhpc.db").stat().st_mode & 0o777 == 0o600
    restored = Store(fresh / "xhpc.db")
    assert restored.deployment_view("m").replicas == store.deployment_view("m").replicas
    assert {d.name for d in restored.deployments()} == {"m", "n"}
    # Never over a file, never into a state that exists.
    with pytest.raises(ValidationError, match="never overwrites"):
        bk.backup(store.db_path, state, tmp_path / "b.tar.gz", "0.1.0")
    with pytest.raises(ValidationError, match="already holds a state"):
        bk.restore(tmp_path / "b.tar.gz", fresh / "xhpc.db", fresh)
    restored.engine.dispose()


async def test_a_restore_is_refused_while_a_broker_runs_or_for_another_broker(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    store = await _served(tmp_path, idle_nodes, model_dir)
    archive = tmp_path / "b.tar.gz"
    bk.backup(store.db_path, tmp_path / "state", archive, "0.1.0")
    busy = tmp_path / "busy"
    busy.mkdir()
    fd = os.open(busy / "broker.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a broker holds it
    try:
        with pytest.raises(ValidationError, match="a broker runs"):
            bk.restore(archive, busy / "xhpc.db", busy)
    finally:
        os.close(fd)
    other = tmp_path / "other"
    other.mkdir()
    (other / "broker-id").write_text("cafe0000\n")
    with pytest.raises(ValidationError, match="names another broker"):
        bk.restore(archive, other / "xhpc.db", other)
    assert not (other / "xhpc.db").exists()


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _manifest(**changed: object) -> bytes:
    fields: dict[str, object] = {
        "format": 1, "xhpc_version": "0.1.0", "schema_version": 1,
        "made_at": "2026-12-01T00:00:00Z", "broker_id": "abcd1234", "deployments": 0,
        "replicas": 0, "db_bytes": 0,
    }  # fmt: skip
    fields.update(changed)
    return json.dumps(fields).encode()


@pytest.mark.adversarial
@pytest.mark.parametrize(
    ("members", "says"),
    [
        ({"manifest.json": _manifest(), "../../etc/x": b"x"}, "holds what no xhpc backup"),
        ({"manifest.json": b"{not json", "xhpc.db": b"", "broker-id": b"x"}, "not valid"),
        ({"manifest.json": _manifest(schema_version=10_000), "xhpc.db": b"", "broker-id": b""},
         "newer than this xhpc"),
        ({"manifest.json": _manifest(broker_id="../x"), "xhpc.db": b"", "broker-id": b""},
         "not valid"),
        ({"manifest.json": _manifest(format=2), "xhpc.db": b"", "broker-id": b""}, "format 2"),
        ({"manifest.json": _manifest(), "broker-id": b"abcd1234"}, "no single file 'xhpc.db'"),
        ({"manifest.json": _manifest(), "xhpc.db": b"SQLite format 3\x00" + b"\x00" * 200,
          "broker-id": b"abcd1234"}, "database"),
        ({"manifest.json": b"x" * (bk.MAX_SMALL + 1), "xhpc.db": b"", "broker-id": b""},
         "too large"),
    ],
)  # fmt: skip
def test_a_hostile_or_broken_archive_is_refused_and_writes_nothing(
    tmp_path: Path, members: dict[str, bytes], says: str
) -> None:
    archive = _archive(tmp_path / "evil.tar.gz", members)
    target = tmp_path / "fresh"
    with pytest.raises(ValidationError, match=says):
        bk.restore(archive, target / "xhpc.db", target)
    assert not (target / "xhpc.db").exists() and not (target / "broker-id").exists()
    assert not (tmp_path / "etc").exists()
    leftovers = list(target.glob(".xhpc-restore.*")) if target.exists() else []
    assert leftovers == []


def test_not_an_archive_and_no_state_are_one_error_each(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a tar")
    with pytest.raises(ValidationError, match="not an xhpc state backup"):
        bk.read_manifest(junk)
    with pytest.raises(ValidationError, match="no state database"):
        bk.backup(tmp_path / "none.db", tmp_path, tmp_path / "out.tar.gz", "0.1.0")
    db = tmp_path / "x.db"
    sqlite3.connect(db).close()
    with pytest.raises(ValidationError, match="no broker id"):
        bk.backup(db, tmp_path, tmp_path / "out.tar.gz", "0.1.0")
    (tmp_path / "broker-id").write_text("abcd1234\n")
    with pytest.raises(ValidationError, match="not an xhpc state database"):
        bk.backup(db, tmp_path, tmp_path / "out.tar.gz", "0.1.0")  # an empty SQLite file
    assert not (tmp_path / "out.tar.gz").exists()


async def test_the_cli_backs_up_shows_and_restores_in_one_line_each(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    store = await _served(tmp_path, idle_nodes, model_dir)
    store.engine.dispose()  # its WAL checkpointed into the file
    os.replace(store.db_path, tmp_path / "state" / "xhpc.db")  # where the config puts it
    archive = tmp_path / "b.tar.gz"

    def xhpc(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "XHPC_STATE_DIR": str(state), "XDG_CONFIG_HOME": str(tmp_path)}
        env.pop("XHPC_SITE_CONFIG", None)
        return subprocess.run([sys.executable, "-m", "xhpc", "state", *args], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    made = xhpc(tmp_path / "state", "backup", str(archive))
    assert made.returncode == 0 and made.stdout.startswith(f"wrote {archive}: broker "), made
    assert "2 deployment(s), 3 active replica(s)" in made.stdout
    shown = json.loads(xhpc(tmp_path / "state", "show", str(archive), "--json").stdout)
    assert shown["deployments"] == 2 and shown["file"] == str(archive)
    done = xhpc(tmp_path / "fresh", "restore", str(archive))
    assert done.returncode == 0 and done.stdout.startswith(f"restored {archive}"), done
    again = xhpc(tmp_path / "fresh", "restore", str(archive))
    assert again.returncode != 0 and again.stdout == ""
    assert again.stderr.startswith("error: ") and "already holds a state" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


async def test_a_postgresql_state_backs_up_and_restores_into_postgresql_or_sqlite(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    postgres: Postgres,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state in PostgreSQL: its rows copied in one snapshot into the backup (the same format
    as SQLite's), restored into a fresh PostgreSQL database with the same deployments and
    events, whose ids go on after the copied ones; the same backup restores into SQLite (a
    state moves between backends); a database that holds a state is never restored into."""
    url = postgres.database()
    monkeypatch.setattr(test_broker_service, "Store", lambda _path: Store(url))
    store = await _served(tmp_path, idle_nodes, model_dir)
    store.add_event(None, "m", "note", "before the backup")
    archive = tmp_path / "pg.tar.gz"
    made = bk.backup(url, tmp_path / "state", archive, "0.2.0")
    assert (made.deployments, made.replicas, made.schema_version) == (2, 3, SCHEMA_VERSION)
    assert archive.stat().st_mode & 0o777 == 0o600

    fresh = postgres.database()
    assert bk.restore(archive, fresh, tmp_path / "fresh") == made
    assert (tmp_path / "fresh" / "broker-id").read_text().strip() == made.broker_id
    assert not list((tmp_path / "fresh").glob(".restore-*"))  # its working copy is gone
    restored = Store(fresh)
    assert restored.deployment_view("m").replicas == store.deployment_view("m").replicas
    assert [e.message for e in restored.events()] == [e.message for e in store.events()]
    restored.add_event(None, "m", "note", "after the restore")  # the id sequence goes on
    assert restored.events()[-1].message == "after the restore"
    with pytest.raises(ValidationError, match="already holds a state"):
        bk.restore(archive, fresh, tmp_path / "again")

    sqlite = tmp_path / "sq" / "xhpc.db"
    bk.restore(archive, sqlite, tmp_path / "sq")
    assert Store(sqlite).deployment_view("n").replicas == store.deployment_view("n").replicas
    # And back: the SQLite state's backup restores into PostgreSQL too.
    again = tmp_path / "sq.tar.gz"
    bk.backup(sqlite, tmp_path / "sq", again, "0.2.0")
    third = postgres.database()
    bk.restore(again, third, tmp_path / "third")
    assert {d.name for d in Store(third).deployments()} == {"m", "n"}


async def test_a_restored_states_lease_runs_out_at_once_and_keeps_its_token(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """The backup was taken while a broker led (its lease copied with it): on the restored
    state a broker of any host leads at once, with the next token (gateways see it higher)."""
    from xhpc.store.lease import Lease

    store = await _served(tmp_path, idle_nodes, model_dir)
    leader = Lease(store, "login1:100:aa", 60)
    assert leader.acquire() and leader.token == 1
    archive = tmp_path / "held.tar.gz"
    bk.backup(store.db_path, tmp_path / "state", archive, "0.2.0")
    fresh = tmp_path / "fresh"
    bk.restore(archive, fresh / "xhpc.db", fresh)
    restored = Store(fresh / "xhpc.db")
    successor = Lease(restored, "login2:200:bb", 60)
    assert successor.acquire()  # not a standby: it would refuse a live holder
    assert successor.token == 2
