"""Routes pushed to the proxies: the broker holds a proxy's sync until its table changes, and the
proxy's route source asks again at once after a new table (component tests, real SQLite)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import make
from xhpc.broker.api import control_app
from xhpc.changes import ReplicaChange, heartbeat
from xhpc.clock import monotonic, utcnow
from xhpc.models import (
    AgentRegistration,
    EngineKind,
    NodeInfo,
    ProxyLoad,
    ReplicaState,
    RoutingTable,
    ServeRequest,
)
from xhpc.proxy import BrokerRouteSource, Router
from xhpc.records import DeploymentRecord, ReplicaRecord
from xhpc.store import Store


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for UNIX sockets (their paths are limited to ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="xhpc-", dir="/tmp") as path:
        yield Path(path)


REG = AgentRegistration(
    replica_id="m-0",
    job_id="100",
    node="n1",
    host="10.0.0.1",
    port=9000,
    gpus=(2,),
    served_model="m",
)


def test_only_sessions_that_write_count_as_writes(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    before = store.writes
    store.deployments()
    store.replicas()
    assert store.writes == before
    with store.session() as s:  # a session that adds nothing
        s.info["unrelated"] = True
    assert store.writes == before


def test_writes_to_tables_routes_are_not_made_of_never_wake_the_proxies(tmp_path: Path) -> None:
    """A batch tenant's events and usage rows (a write a second or more under a flood) and the
    agents' heartbeats leave the count alone: only deployments, replicas and units make the
    routing table, and never by their heartbeat."""
    store = Store(tmp_path / "x.db")
    before = store.writes
    for i in range(3):
        store.add_event(None, "d", "note", f"event {i}")
    assert store.writes == before
    replica = ReplicaRecord(replica_id="d-0", deployment="d", index=0,
                            state=ReplicaState.CREATING, engine=EngineKind.VLLM,
                            created_at=utcnow(), updated_at=utcnow())  # fmt: skip
    store.create_deployment(DeploymentRecord(name="d", model="m", model_path="/m",
                                             engine=EngineKind.VLLM, gpus=1,
                                             created_at=utcnow()), [replica])  # fmt: skip
    assert store.writes == before + 1
    for _ in range(3):  # an agent's heartbeats: a column routes never read
        store.update_replica("d-0", heartbeat(utcnow()))
    assert store.writes == before + 1
    store.update_replica("d-0", ReplicaChange(host="10.0.0.9", last_heartbeat=utcnow()))
    assert store.writes == before + 2


async def test_a_held_sync_answers_when_a_replica_becomes_ready(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    writes = service.store.writes
    current = service.routes()
    assert writes > 0 and current.routes == ()
    async with TestClient(TestServer(control_app(service))) as client:
        held = ProxyLoad(proxy_id="p", table_version=current.version, wait_s=30)

        async def sync() -> tuple[RoutingTable, float]:
            resp = await client.post("/v1/proxy/sync", data=held.model_dump_json())
            assert resp.status == 200
            return RoutingTable.model_validate_json(await resp.read()), monotonic()

        task = asyncio.create_task(sync())
        await asyncio.sleep(0.2)
        assert not task.done()  # nothing changed: the answer is held
        registered = monotonic()
        service.agents.register(REG)  # READY: a write to the store
        table, answered = await asyncio.wait_for(task, 10)
        assert [r.replica_id for r in table.routes] == ["m-0"]
        assert table.version != current.version
        assert answered - registered < 10  # pushed, not the 30 s wait run out
        # A proxy that holds an older table gets the current one at once.
        stale = ProxyLoad(proxy_id="p", table_version=current.version, wait_s=30)
        resp = await client.post("/v1/proxy/sync", data=stale.model_dump_json())
        assert RoutingTable.model_validate_json(await resp.read()) == table


async def test_a_held_sync_ends_after_its_wait_with_the_same_table(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    current = service.routes()
    before = monotonic()
    # A write that leaves the table as it is (a heartbeat) does not end the wait.
    service.store.update_replica("m-0", ReplicaChange(reason="still queued"))
    table = await service.proxies.routes_after(current.version, 0.3)
    assert table == current and monotonic() - before >= 0.3


class HoldingBroker:
    """A broker stand-in that answers each sync once its table differs from the proxy's."""

    def __init__(self) -> None:
        self.table = RoutingTable(version=1, models=("m",))
        self.changed = asyncio.Event()
        self.loads: list[ProxyLoad] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/proxy/sync", self.sync)
        return app

    async def sync(self, request: web.Request) -> web.Response:
        load = ProxyLoad.model_validate_json(await request.text())
        self.loads.append(load)
        if load.table_version == self.table.version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), load.wait_s)
        return web.Response(text=self.table.model_dump_json(), content_type="application/json")

    def publish(self, table: RoutingTable) -> None:
        self.table = table
        self.changed.set()
        self.changed = asyncio.Event()


@contextlib.asynccontextmanager
async def polling(broker: HoldingBroker, path: Path, interval_s: float) -> AsyncIterator[Router]:
    """``broker`` on the unix socket ``path``, and a route source polling it into a router."""
    runner = web.AppRunner(broker.app())
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    router = Router()
    task = asyncio.create_task(BrokerRouteSource(path, interval_s=interval_s).run(router))
    try:
        yield router
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        broker.changed.set()  # a held answer ends now, not after its wait
        await runner.cleanup()


async def test_the_route_source_applies_a_pushed_table_at_once(sock_dir: Path) -> None:
    broker = HoldingBroker()
    # A long interval: anything faster than it is the push, not a poll.
    async with polling(broker, sock_dir / "broker.sock", 20.0) as router:
        deadline = monotonic() + 10
        while router.table.version != 1 or len(broker.loads) < 2:
            assert monotonic() < deadline, "the source never held a sync"
            await asyncio.sleep(0.01)
        # The first fetch asks without waiting; the next ones are held, each for the interval.
        assert broker.loads[0].wait_s == 0 and broker.loads[1].wait_s == 20.0
        published = monotonic()
        broker.publish(RoutingTable(version=2, models=("m", "n")))
        while router.table.version != 2:
            assert monotonic() - published < 10, "a pushed table was not applied"
            await asyncio.sleep(0.01)
        # ... and it asks again at once, saying which table it holds now.
        while not any(load.table_version == 2 for load in broker.loads):
            assert monotonic() - published < 10, "no sync after the new table"
            await asyncio.sleep(0.01)
        assert router.table.models == ("m", "n")


async def test_a_broker_that_answers_at_once_is_asked_once_per_interval(sock_dir: Path) -> None:
    """A broker that does not hold answers (or is down) is not asked in a tight loop."""
    broker = HoldingBroker()
    broker.changed.set()  # every wait ends at once
    async with polling(broker, sock_dir / "broker.sock", 0.25):
        await asyncio.sleep(1.0)
    assert 2 <= len(broker.loads) <= 7
