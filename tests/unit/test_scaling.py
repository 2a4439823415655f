"""Scaling: which replicas go first, when a drained replica's job is cancelled, the gates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.unit.test_broker_service import make
from xhpc.broker.plan.scaling import pick_removals
from xhpc.broker.watch.drain import DrainBook
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import (
    AgentRegistration,
    NodeInfo,
    ProxyLoad,
    ReplicaState,
    ReplicaView,
    Route,
    RoutingTable,
    ServeRequest,
)
from xhpc.store import ReplicaRow, replica_record


def row(idx: int, state: str) -> ReplicaView:
    now = utcnow()
    return replica_record(
        ReplicaRow(
            replica_id=f"m-{idx}",
            deployment="m",
            idx=idx,
            state=state,
            engine="vllm",
            created_at=now,
            updated_at=now,
        )
    )


def test_not_yet_serving_goes_first_then_least_loaded_then_newest() -> None:
    rows = [row(0, "READY"), row(1, "READY"), row(2, "READY"), row(3, "QUEUED")]
    load = {"m-0": 0, "m-1": 5, "m-2": 0}.get
    picked = pick_removals(rows, 3, lambda rid: load(rid, 0))
    assert [r.replica_id for r in picked] == ["m-3", "m-2", "m-0"]
    assert pick_removals(rows, 0, lambda rid: 0) == []


def _table(*replicas: str) -> RoutingTable:
    routes = tuple(
        Route(model="m", replica_id=r, url="http://h:1", served_model="m") for r in replicas
    )
    return RoutingTable(version=hash(replicas) & 0xFFFF, models=("m",), routes=routes)


def test_drained_needs_every_recent_proxy_to_have_let_go() -> None:
    book = DrainBook()
    assert book.drained("m-1")  # no proxy heard from: nobody routes
    old, new = _table("m-0", "m-1"), _table("m-0")
    book.served(old)
    book.served(new)
    book.heard(ProxyLoad(proxy_id="p", table_version=old.version, outstanding={}))
    assert not book.drained("m-1")  # the proxy still holds a table routing to m-1
    book.heard(ProxyLoad(proxy_id="p", table_version=new.version, outstanding={"m-1": 2}))
    assert not book.drained("m-1") and book.outstanding("m-1") == 2
    book.heard(ProxyLoad(proxy_id="p", table_version=new.version, outstanding={}))
    assert book.drained("m-1")
    book.heard(ProxyLoad(proxy_id="q", table_version=12345, outstanding={}))  # unknown version
    assert not book.drained("m-1")


def test_routed_needs_every_recent_proxy_to_hold_the_new_replicas() -> None:
    book = DrainBook()
    assert book.routed(["m-1"])  # no proxy heard from: nothing to wait for
    old, new = _table("m-0"), _table("m-0", "m-1")
    book.served(old)
    book.served(new)
    book.heard(ProxyLoad(proxy_id="p", table_version=new.version, outstanding={}))
    book.heard(ProxyLoad(proxy_id="q", table_version=old.version, outstanding={}))
    assert book.routed(["m-0"]) and not book.routed(["m-0", "m-1"])  # q lags
    book.heard(ProxyLoad(proxy_id="q", table_version=new.version, outstanding={}))
    assert book.routed(["m-0", "m-1"])
    book.heard(ProxyLoad(proxy_id="r", table_version=12345, outstanding={}))  # unknown version
    assert not book.routed(["m-0"])


async def test_a_deployment_is_routed_once_every_proxy_holds_its_ready_replicas(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir), replicas=1))
    assert service.deployment("m").routed  # nothing READY yet: nothing to wait for
    reg = AgentRegistration(
        replica_id="m-0",
        job_id=slurm.submitted[0],
        node="n1",
        host="10.0.0.1",
        port=9000,
        served_model="m",
    )
    service.agents.register(reg)
    table = service.routes()
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=0, outstanding={}))
    assert not service.deployment("m").routed  # the proxy holds an older table
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=table.version, outstanding={}))
    assert service.deployment("m").routed


async def test_scale_up_same_and_down(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    service.config.broker.drain_timeout_s = 30.0
    await service.serve(ServeRequest(model=str(model_dir), replicas=2))
    up = await service.scale("m", 3)
    assert up.added == ("m-2",) and up.previous == 2
    same = await service.scale("m", 3)
    assert (same.added, same.removed) == ((), ())
    assert len(slurm.submitted) == 3
    for i, job in enumerate(slurm.submitted):
        service.agents.register(
            AgentRegistration(
                replica_id=f"m-{i}",
                job_id=job,
                node="n1",
                host="10.0.0.1",
                port=9000 + i,
                served_model="m",
            )
        )
    table = service.routes()
    service.drains.heard(
        ProxyLoad(proxy_id="p", table_version=table.version, outstanding={"m-1": 1})
    )
    down = await service.scale("m", 2)
    assert down.removed == ("m-2",)  # m-1 is busy; m-0 and m-2 idle: the newest goes
    assert service.store.replica("m-2").state == "DRAINING"
    await asyncio.sleep(0.5)
    assert slurm.cancelled == []  # the proxy still holds a table with m-2
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=service.routes().version))
    for _ in range(50):
        if slurm.cancelled:
            break
        await asyncio.sleep(0.1)
    assert slurm.cancelled == [slurm.submitted[2]]


async def test_scale_gates(tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path) -> None:
    service, _ = make(tmp_path, idle_nodes)
    with pytest.raises(NotFoundError):
        await service.scale("nope", 1)
    await service.serve(ServeRequest(model=str(model_dir)))
    with pytest.raises(ValidationError):
        await service.scale("m", -1)
    await service.stop("m")
    service.lifecycle.move(service.store.replica("m-0"), ReplicaState.STOPPED, "job ended")
    with pytest.raises(ValidationError, match="not running"):
        await service.scale("m", 2)
