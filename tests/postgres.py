"""A PostgreSQL server of a test's own, from Debian's package (``postgresql``): initialised in a
fresh directory, listening on a Unix socket only (no TCP), run as the ``postgres`` user when the
tests run as root (PostgreSQL refuses root); the test's Unix user gets a role of its own name by
peer authentication, so no password exists anywhere. ``Postgres.database()`` makes an empty
database and gives its URL."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory, if any."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    return found[-1].parent if found else None


@dataclass
class Postgres:
    bin: Path
    base: Path
    as_postgres: bool
    made: int = 0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.base / "server.log"

    @property
    def sock(self) -> Path:
        return self.base / "sock"

    def _as_server(self, *argv: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if self.as_postgres else list(argv)

    def start(self) -> None:
        data = self.base / "data"
        self.sock.mkdir()
        if self.as_postgres:
            shutil.chown(self.base, "postgres")
            shutil.chown(self.sock, "postgres")
        subprocess.run(
            self._as_server(str(self.bin / "initdb"), "-D", str(data), "-U", "postgres",
                            "--auth-local=peer", "--auth-host=reject", "-E", "UTF8"),
            check=True, capture_output=True, timeout=120, cwd="/",
        )  # fmt: skip
        opts = f"-k {self.sock} -c listen_addresses='' -c fsync=off"
        subprocess.run(
            self._as_server(str(self.bin / "pg_ctl"), "-D", str(data), "-o", opts, "-l",
                            str(self.log), "-w", "-t", "60", "start"),
            check=True, capture_output=True, timeout=90, cwd="/",
        )  # fmt: skip
        me = getpass.getuser()
        if me != "postgres":
            self.psql("postgres", "postgres", f'CREATE ROLE "{me}" LOGIN CREATEDB')

    def psql(self, user: str, db: str, sql: str) -> None:
        argv = [str(self.bin / "psql"), "-h", str(self.sock), "-U", user, "-d", db,
                "-v", "ON_ERROR_STOP=1", "-qc", sql]  # fmt: skip
        as_user = self._as_server(*argv) if user == "postgres" else argv
        subprocess.run(as_user, check=True, capture_output=True, timeout=60, cwd="/")

    def database(self) -> str:
        """A new empty database owned by the test's user: its URL."""
        self.made += 1
        name = f"xhpc_test_{os.getpid()}_{self.made}"
        me = getpass.getuser()
        self.psql(me, "postgres", f'CREATE DATABASE "{name}"')
        return f"postgresql://{me}@/{name}?host={self.sock}"

    def stop(self) -> None:
        subprocess.run(
            self._as_server(str(self.bin / "pg_ctl"), "-D", str(self.base / "data"), "-m",
                            "immediate", "-w", "stop"),
            check=False, capture_output=True, timeout=60, cwd="/",
        )  # fmt: skip
        shutil.rmtree(self.base, ignore_errors=True)


def start_postgres() -> Postgres | None:
    """A running server, or None where PostgreSQL is not installed."""
    bin_dir = pg_bin()
    if bin_dir is None:
        return None
    base = Path(tempfile.mkdtemp(prefix="xhpc-pg-", dir="/tmp"))
    base.chmod(0o755)  # the server's user enters it; its data directory stays its own (0700)
    pg = Postgres(bin_dir, base, as_postgres=os.geteuid() == 0)
    try:
        pg.start()
    except BaseException:
        pg.stop()
        raise
    return pg
