"""The state store on its two backends: SQLite (the default) and PostgreSQL (brokers on two login
nodes), a server of the test's own (tests/postgres.py). Both end with the same tables and
columns (SQLite by its migrations, a new PostgreSQL database from the table definitions at the
same schema version); the broker's own flows (serve, the agents' protocol, reconcile and stop,
scale, autoscaling, pilots) run unchanged on PostgreSQL; the leader's lease takes over
and fences there as on SQLite (its check reads the row FOR SHARE)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Engine

from tests.postgres import Postgres
from tests.unit import test_autoscale_desk, test_broker_service, test_pilot
from tests.unit.test_lease import Clock
from xhpc.errors import FencedError
from xhpc.models import NodeInfo
from xhpc.settings import XhpcConfig
from xhpc.store import Store
from xhpc.store.lease import Lease
from xhpc.store.tables import SCHEMA_VERSION


def _columns(engine: Engine) -> dict[str, set[str]]:
    found = sa_inspect(engine)
    return {t: {c["name"] for c in found.get_columns(t)} for t in found.get_table_names()}


def test_both_backends_have_the_same_tables_and_columns(tmp_path: Path, postgres: Postgres) -> None:
    lite = Store(tmp_path / "x.db")
    server = Store(postgres.database())
    assert server.dialect == "postgresql" and lite.dialect == "sqlite"
    assert _columns(server.engine) == _columns(lite.engine)
    assert server.schema_version() == lite.schema_version() == SCHEMA_VERSION
    again = Store(str(server.db_path))  # opened again: nothing to migrate, nothing changed
    assert again.schema_version() == SCHEMA_VERSION
    assert _columns(again.engine) == _columns(lite.engine)


FLOWS: list[Callable[..., Awaitable[None]]] = [
    test_broker_service.test_creating_is_written_before_sbatch,
    test_broker_service.test_failed_sbatch_leaves_no_partial_deployment,
    test_broker_service.test_token_is_private_and_only_its_hash_is_stored,
    test_broker_service.test_agent_protocol_moves_states_and_routes,
    test_broker_service.test_reconcile_and_stop,
    test_broker_service.test_replicas_that_fit_nowhere_now_wait_in_slurms_queue,
    test_autoscale_desk.test_a_fixed_deployment_is_left_alone,
    test_autoscale_desk.test_asleep_it_lives_on_and_stopped_it_ends,
    test_autoscale_desk.test_a_stopped_deployment_is_never_started_again_while_its_replicas_end,
    test_pilot.test_serve_into_a_pilot_then_stop_cancels_the_empty_pilot,
    test_pilot.test_scale_up_remembers_the_gpu_type_and_the_pilot,
]


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__.removeprefix("test_"))
async def test_the_brokers_flows_run_on_postgresql(
    flow: Callable[..., Awaitable[None]],
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    postgres: Postgres,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unit tests' broker (``make``) on a PostgreSQL store: each flow passes as it does on
    SQLite."""
    stores: list[Store] = []

    def on_postgres(_path: Any) -> Store:
        stores.append(Store(postgres.database()))
        return stores[-1]

    monkeypatch.setattr(test_broker_service, "Store", on_postgres)
    await flow(tmp_path, idle_nodes, model_dir)
    assert stores and all(s.dialect == "postgresql" for s in stores)


def test_the_lease_takes_over_and_fences_on_postgresql(postgres: Postgres) -> None:
    clock = Clock()
    url = postgres.database()
    a = Lease(Store(url), "login1:100", ttl_s=10, clock=clock)
    b = Lease(Store(url), "login2:200", ttl_s=10, clock=clock)
    assert a.acquire() and not b.acquire()
    a.store.fence = a.check
    a.store.add_event(None, "d", "note", "the first leader's")
    clock.now += timedelta(seconds=11)
    assert b.acquire() and b.token == 2
    with pytest.raises(FencedError):
        a.store.add_event(None, "d", "note", "after the takeover")
    notes = [e.message for e in b.store.events(limit=10)]
    assert notes == ["the first leader's"]
    assert not a.renew()


@pytest.mark.adversarial
@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql://xhpc:secret@db/xhpc", "holds a password"),
        ("mysql://xhpc@db/xhpc", "must be a PostgreSQL URL"),
        ("sqlite:///tmp/x.db", "must be a PostgreSQL URL"),
        ("postgresql://xhpc@db/xhpc\n-c x", "control characters"),
        ("db/xhpc", "must be a PostgreSQL URL"),
    ],
)
def test_a_hostile_db_url_is_refused_in_one_line_and_never_echoed(url: str, why: str) -> None:
    """The site's ``db_url``: a password (it would sit in a config file others may read), another
    database, control characters: refused when the config loads, the password never shown."""
    with pytest.raises(PydanticValidationError) as info:
        XhpcConfig(db_url=url)
    first = info.value.errors()[0]
    assert why in first["msg"] and "secret" not in first["msg"], first["msg"]
