"""A key's cap on concurrent requests: `xhpc keys create --max-concurrent N`, stored with the
key (migration 9), listed, and handed to the proxies with the grants."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from xhpc.access import KeyCreate, KeyCreated
from xhpc.cli.admin.keys import keys
from xhpc.cli.context import Ctx
from xhpc.client.control import Client
from xhpc.config import load_config
from xhpc.store import Store
from xhpc.store.keys import Keys
from xhpc.store.tables import MIGRATIONS


def test_the_cap_is_stored_and_reaches_the_grants(tmp_path: Path) -> None:
    store = Keys(Store(tmp_path / "x.db"))
    view, _ = store.create(KeyCreate(user="alice", max_concurrent=3))
    other, _ = store.create(KeyCreate(user="bob"))
    assert view.max_concurrent == 3 and other.max_concurrent is None
    assert {g.user: g.max_concurrent for g in store.grants()} == {"alice": 3, "bob": None}
    assert [v.max_concurrent for v in store.all()] == [3, None]


def test_an_older_database_gets_the_column(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    with sqlite3.connect(db) as conn:  # the schema as version 8 left it
        conn.execute("CREATE TABLE schema_version (version INTEGER)")
        for version, statements in MIGRATIONS:
            if version > 8:
                break
            for sql in statements:
                conn.execute(sql)
            conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
    store = Keys(Store(db))
    view, _ = store.create(KeyCreate(user="alice", max_concurrent=2))
    assert view.max_concurrent == 2


@dataclass
class FakeBroker:
    posted: list[tuple[str, Any]] = field(default_factory=list)

    def post(self, path: str, body: str) -> Any:
        req = KeyCreate.model_validate_json(body)
        self.posted.append((path, req))
        view = {"key_id": "0123456789ab", "user": req.user, "created_at": "2026-01-01T00:00:00Z"}
        view["max_concurrent"] = req.max_concurrent  # type: ignore[assignment]
        return json.loads(KeyCreated.model_validate({"view": view, "key": "k"}).model_dump_json())


@dataclass
class FakeCtx(Ctx):
    fake: FakeBroker = field(default_factory=FakeBroker)

    @property
    def broker(self) -> Any:
        return Client.over(self.fake)  # type: ignore[arg-type]


def test_keys_create_takes_max_concurrent(clean_env: Path) -> None:
    config, sources = load_config()
    ctx = FakeCtx(config=config, sources=sources)
    args = ["create", "--user", "alice", "--max-concurrent", "4", "--json"]
    result = CliRunner().invoke(keys, args, obj=ctx)
    assert result.exit_code == 0, result.output
    ((path, req),) = ctx.fake.posted
    assert path == "/v1/keys" and req.max_concurrent == 4
    assert json.loads(result.output)["view"]["max_concurrent"] == 4
    result = CliRunner().invoke(keys, ["create", "--user", "a", "--max-concurrent", "0"], obj=ctx)
    assert result.exit_code != 0
    assert "--max-concurrent must be at least 1" in str(result.exception or result.output)
