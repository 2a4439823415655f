"""The broker's LoRA adapter desk (``xhpc.broker.desks.adapter_desk``) against fake engines on
loopback that answer vLLM's runtime adapter API: every READY replica of a base holds exactly its
adapters, an adapter is routed by its name only where it is loaded, a removed one leaves the
routes at once and its engines at the next sync, an engine that fails a load is asked again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from tests.proxy_fakes import serve
from tests.unit.test_broker_service import make
from xhpc.access import Caller
from xhpc.broker.desks import adapter_desk
from xhpc.broker.desks.adapter_desk import AdapterDesk, ledger_model
from xhpc.clock import utcnow
from xhpc.engine_config import ModelEngineConfig
from xhpc.errors import AdmissionError, NotFoundError, ValidationError
from xhpc.models import EngineKind, NodeInfo, ReplicaState, Route, ServeRequest
from xhpc.records import AdapterRecord, DeploymentRecord, ReplicaRecord
from xhpc.store import Store


class LoraEngine:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, behind a secret."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.held: set[str] = set()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.secret}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        body: dict[str, Any] = await request.json()
        self.calls.append((request.path, body))
        if self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return body

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name = body["lora_name"]
        if name in self.held:
            message = f"The lora adapter '{name}' has already been loaded."
            return web.json_response({"error": {"message": message}}, status=400)
        self.held.add(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.held.discard(body["lora_name"])
        return web.Response(text="Success")


def _row(rid: str, dep: str, url: str, secret: str, state: ReplicaState) -> ReplicaRecord:
    parts = urlsplit(url)
    now = utcnow()
    return ReplicaRecord(
        replica_id=rid, deployment=dep, index=0, state=state, engine=EngineKind.VLLM,
        host=parts.hostname, port=parts.port, created_at=now, updated_at=now,
        engine_secret=secret,
    )  # fmt: skip


SERVED = utcnow()  # when each test's deployments were served


def _served(store: Store, *names: str) -> Store:
    for name in names:
        store.create_deployment(DeploymentRecord(name=name, model="m", model_path="/m",
                                                 engine=EngineKind.VLLM, gpus=1,
                                                 created_at=SERVED), [])  # fmt: skip
    return store


def _adapter(name: str, base: str) -> AdapterRecord:
    return AdapterRecord(name=name, base=base, path=f"/a/{name}", owner="ann", digest="d",
                         created_at=utcnow(), base_created_at=SERVED)  # fmt: skip


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, tuple[LoraEngine, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        out = {}
        for rid in ("llama-0", "llama-1", "qwen-0"):
            engine = LoraEngine(f"secret-{rid}")
            out[rid] = (engine, await stack.enter_async_context(serve(engine.app())))
        yield out


async def test_every_ready_replica_holds_its_bases_adapters_and_only_they_are_routed(
    tmp_path: Path, engines: dict[str, tuple[LoraEngine, str]]
) -> None:
    desk = AdapterDesk(_served(Store(tmp_path / "x.db"), "llama", "qwen"))
    try:
        desk.adapters.add(_adapter("a1", "llama"))
        desk.adapters.add(_adapter("q1", "qwen"))
        rows = [
            _row(rid, rid.split("-")[0], url, engine.secret, ReplicaState.READY)
            for rid, (engine, url) in engines.items()
        ]
        base = [Route(model=r.deployment, replica_id=r.replica_id, url=f"http://{r.host}:{r.port}",
                      served_model=r.deployment) for r in rows]  # fmt: skip
        await desk.sync(rows)
        assert {rid: e.held for rid, (e, _) in engines.items()} == {
            "llama-0": {"a1"},
            "llama-1": {"a1"},
            "qwen-0": {"q1"},
        }
        (call_path, body), *_ = engines["llama-0"][0].calls
        assert call_path == "/v1/load_lora_adapter" and body == {"lora_name": "a1",
                                                                  "lora_path": "/a/a1"}  # fmt: skip
        routed = {(r.model, r.replica_id, r.served_model) for r in desk.routes(base)}
        assert routed == {("a1", "llama-0", "a1"), ("a1", "llama-1", "a1"),
                          ("q1", "qwen-0", "q1")}  # fmt: skip
        await desk.sync(rows)  # nothing more to do
        assert len(engines["llama-0"][0].calls) == 1

        # A restarted broker finds it loaded already: that counts as loaded.
        again = AdapterDesk(Store(tmp_path / "x.db"))
        await again.sync(rows)
        assert "a1" in again.loaded["llama-1"]
        await again.close()

        # An engine that fails a load holds nothing, routes nothing, and is asked again.
        desk.adapters.add(_adapter("a2", "llama"))
        engines["llama-1"][0].fail = True
        await desk.sync(rows)
        assert {r.replica_id for r in desk.routes(base) if r.model == "a2"} == {"llama-0"}
        engines["llama-1"][0].fail = False
        asked = len(engines["llama-1"][0].calls)
        await desk.sync(rows)  # not at once again: after a second (then 2, 4, ... up to 60)
        assert len(engines["llama-1"][0].calls) == asked

        async def routed_on_both() -> bool:
            for _ in range(60):
                await desk.sync(rows)
                if {r.replica_id for r in desk.routes(base) if r.model == "a2"} == {
                    "llama-0",
                    "llama-1",
                }:
                    return True
                await asyncio.sleep(0.05)
            return False

        assert await routed_on_both()

        # Each load is in the weights ledger: the adapter's files, used by the replica.
        (copy,) = desk.ledger.copies(model=ledger_model("a1"))
        assert (
            copy.node is None and copy.path == "/a/a1" and {"llama-0", "llama-1"} <= set(copy.users)
        )
        (view,) = [v for v in desk.views() if v.name == "a1"]
        assert view.loaded_on == ("llama-0", "llama-1") and set(view.load_s) == {
            "llama-0",
            "llama-1",
        }

        # Removed: out of the routes at once, unloaded at the next sync.
        desk.remove("a1")
        assert "a1" not in {r.model for r in desk.routes(base)}
        await desk.sync(rows)
        assert engines["llama-0"][0].held == {"a2"} and engines["llama-1"][0].held == {"a2"}

        # A replica no longer READY is forgotten; back READY, it is loaded again.
        draining = [r.model_copy(update={"state": ReplicaState.DRAINING}) if r.replica_id ==
                    "llama-0" else r for r in rows]  # fmt: skip
        await desk.sync(draining)
        assert "llama-0" not in desk.loaded

        # Its base ended: the adapter goes with it, before anything serves that name again
        # (perhaps another user's deployment), and leaves the ledger.
        assert desk.ledger.shared(ledger_model("q1")) is not None
        desk.store.mark_deployment_stopped("qwen")
        assert "q1" not in {r.model for r in desk.routes(base)}  # at once
        await desk.sync([r for r in rows if r.deployment == "llama"])
        assert [a.name for a in desk.adapters.all()] == ["a2"]
        assert desk.ledger.shared(ledger_model("q1")) is None
    finally:
        await desk.close()


# --- admission: xhpc adapters add ---------------------------------------------------------


def _tiny_adapter(root: Path, rank: int = 8) -> Path:
    d = root / "a1"
    d.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "target_modules": ["q_proj", "v_proj"]}
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return d


async def test_an_adapter_is_admitted_whole_on_its_owner_s_deployment_with_room_for_it(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    lora = ModelEngineConfig(lora={"max_loras": 2, "max_lora_rank": 8})
    ann = Caller(user="ann", uid=os.getuid())
    bob = Caller(user="bob", uid=os.getuid() + 1)
    await service.serve(ServeRequest(model=str(model_dir), name="base", engine=EngineKind.VLLM,
                                     engine_config=lora), ann)  # fmt: skip
    await service.serve(ServeRequest(model=str(model_dir), name="plain"), ann)
    desk = service.adapter_desk
    path = _tiny_adapter(tmp_path / "ad")
    added = desk.add("a1", "base", str(path), ann)
    assert added.owner == "ann" and added.base == "base" and added.digest.startswith("sha256:")
    assert added.size_bytes == sum(f.stat().st_size for f in path.iterdir())
    assert [a.name for a in desk.adapters.all()] == ["a1"]
    with pytest.raises(ValidationError, match="exists"):
        desk.add("a1", "base", str(path), ann)
    with pytest.raises(PermissionError):
        desk.add("b1", "base", str(path), bob)  # not bob's deployment
    with pytest.raises(NotFoundError):
        desk.add("b1", "nope", str(path), ann)
    with pytest.raises(AdmissionError) as refused:
        desk.add("plain", "plain", "relative/dir", ann)
    found = refused.value.problems
    assert any("a deployment is named 'plain'" in p for p in found), found
    assert any("no room for adapters" in p for p in found), found
    assert any("must be absolute" in p for p in found), found
    big = _tiny_adapter(tmp_path / "big", rank=16)
    with pytest.raises(AdmissionError, match=r"1\.\.8"):
        desk.add("b2", "base", str(big), ann)
    # Keyed as its base is: the owner's keys and the base's account's.
    (base_access,) = [m for m in service.proxies.access() if m.model == "base"]
    (access,) = [m for m in service.proxies.access() if m.model == "a1"]
    assert (access.owner, access.account) == ("ann", base_access.account)
    table = service.proxies.routes()
    assert "a1" in table.models and table.parents == {"a1": "base"}
    with pytest.raises(PermissionError):
        desk.remove("a1", bob)
    desk.ledger.record(ledger_model("a1"), None, str(path), 1, added.digest, user="r")
    assert desk.remove("a1", ann).name == "a1"
    assert desk.ledger.shared(ledger_model("a1")) is None  # removed: out of the ledger


async def test_a_registering_replica_holds_its_adapters_before_it_is_ready(
    tmp_path: Path, engines: dict[str, tuple[LoraEngine, str]]
) -> None:
    """A successor or replacement takes its adapters' traffic the moment it takes its base's;
    no sync runs in between (it would forget a replica not READY yet)."""
    desk = AdapterDesk(_served(Store(tmp_path / "x.db"), "llama", "qwen"))
    try:
        desk.adapters.add(_adapter("a1", "llama"))
        desk.adapters.add(_adapter("q1", "qwen"))
        engine, url = engines["llama-0"]
        starting = _row("llama-0", "llama", "http://127.0.0.1:1", engine.secret,
                        ReplicaState.STARTING)  # fmt: skip
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        async with desk.registering(starting, parts.hostname, parts.port):
            assert engine.held == {"a1"}  # its own base's adapters, at the address it registers
            syncing = asyncio.create_task(desk.sync([]))
            await asyncio.sleep(0.05)
            assert not syncing.done() and desk.loaded == {"llama-0": {"a1"}}
        await syncing  # it ran after: the replica still not READY in what it was given
        ready = _row("llama-0", "llama", url, engine.secret, ReplicaState.READY)
        ready = ready.model_copy(update={"ready_at": utcnow()})
        async with desk.registering(starting, parts.hostname, parts.port):
            pass
        await desk.sync([ready])
        (view,) = [v for v in desk.views() if v.name == "a1"]
        assert view.loaded_on == ("llama-0",) and view.load_s == {"llama-0": 0.0}

        # An engine that fails the load still registers (its base serves); sync asks again.
        other, other_url = engines["llama-1"]
        other.fail = True
        p = urlsplit(other_url)
        assert p.hostname is not None and p.port is not None
        async with desk.registering(_row("llama-1", "llama", other_url, other.secret,
                                         ReplicaState.STARTING), p.hostname, p.port):  # fmt: skip
            pass
        assert "a1" not in desk.loaded.get("llama-1", set())
    finally:
        await desk.close()


class HungEngine(LoraEngine):
    """Takes a load and answers it only once released (at the test's end)."""

    def __init__(self, secret: str) -> None:
        super().__init__(secret)
        self.release = asyncio.Event()

    async def load(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.Response(status=503)


async def test_an_engine_that_hangs_holds_up_neither_the_others_nor_the_reconcile_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_desk, "CALL_TIMEOUT_S", 0.5)
    desk = AdapterDesk(_served(Store(tmp_path / "x.db"), "llama"))
    desk.adapters.add(_adapter("a1", "llama"))
    hung, fine = HungEngine("s-hung"), LoraEngine("s-fine")
    async with serve(hung.app()) as hung_url, serve(fine.app()) as fine_url:
        rows = [_row("llama-0", "llama", hung_url, hung.secret, ReplicaState.READY),
                _row("llama-1", "llama", fine_url, fine.secret, ReplicaState.READY)]  # fmt: skip
        try:
            desk.kick(rows)  # returns at once; the pass runs in the background
            assert desk._calls.passes.task is not None and not desk._calls.passes.task.done()
            desk.kick(rows)  # one at a time: this one is skipped
            await asyncio.wait_for(
                desk._calls.passes.task, 5
            )  # the hung call timed out, the other loaded
            assert fine.held == {"a1"} and desk.loaded == {"llama-0": set(), "llama-1": {"a1"}}
        finally:
            hung.release.set()
            await desk.close()
