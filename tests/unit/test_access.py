"""Keys, ownership and the replica's guard: digests only, constant-time checks, owners act on
their own models, and a replica's port refuses requests without its secret."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.unit.test_broker_service import make
from xhpc.access import (
    Caller,
    KeyCreate,
    KeyGrant,
    ModelAccess,
    UsageCount,
    check_owner,
    digest_matches,
    may_use,
    split_key,
)
from xhpc.agent.guard import EngineGuard, bearer_ok
from xhpc.models import NodeInfo, ServeRequest
from xhpc.store import Store
from xhpc.store.keys import Keys


def test_a_key_is_shown_once_and_only_its_digest_is_stored(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    keys = Keys(store)
    view, key = keys.create(KeyCreate(user="alice", account="lab1", rpm=60))
    parts = split_key(key)
    assert parts is not None and parts[0] == view.key_id
    (grant,) = keys.grants()
    assert digest_matches(parts[1], grant.digest)
    assert not digest_matches(parts[1] + "x", grant.digest)
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("x.db*"))
    assert parts[1].encode() not in stored and parts[0].encode() in stored
    assert (tmp_path / "x.db").stat().st_mode & 0o777 == 0o600
    for bad in ("", "xhpc-", "sk-abc", f"xhpc-{view.key_id}", key + "\n"):
        assert split_key(bad) is None


def test_revoked_keys_leave_the_grants_and_usage_adds_up(tmp_path: Path) -> None:
    keys = Keys(Store(tmp_path / "x.db"))
    a, _ = keys.create(KeyCreate(user="alice", token_quota=100))
    b, _ = keys.create(KeyCreate(user="bob"))
    keys.add_usage({a.key_id: {"m": UsageCount(requests=1, prompt_tokens=3, completion_tokens=4)}})
    keys.add_usage({a.key_id: {"m": UsageCount(requests=2, prompt_tokens=1, completion_tokens=2)}})
    assert {g.key_id: g.tokens_used for g in keys.grants()} == {a.key_id: 10, b.key_id: 0}
    (line,) = keys.usage()
    assert (line.user, line.requests, line.prompt_tokens, line.completion_tokens) == (
        "alice", 3, 4, 6,
    )  # fmt: skip
    assert keys.revoke(b.key_id).revoked_at is not None
    assert [g.key_id for g in keys.grants()] == [a.key_id]


def test_who_may_use_a_model() -> None:
    alice = KeyGrant(key_id="1", digest="d", user="alice", account="lab1")
    admin = KeyGrant(key_id="2", digest="d", user="root", admin=True)
    own = ModelAccess(model="m", owner="alice", account="lab9")
    shared = ModelAccess(model="m", owner="bob", account="lab1")
    other = ModelAccess(model="m", owner="bob", account="lab2")
    assert may_use(alice, own) and may_use(alice, shared)
    assert not may_use(alice, other) and not may_use(alice, None)
    assert may_use(admin, other) and may_use(admin, None)


def test_owners_and_admins_act_on_a_deployment() -> None:
    check_owner(None, "alice", "m")  # the broker itself
    check_owner(Caller(user="alice", uid=1000), "alice", "m")
    check_owner(Caller(user="root", uid=0, admin=True), "alice", "m")
    with pytest.raises(PermissionError, match="m belongs to alice; you are bob"):
        check_owner(Caller(user="bob", uid=1001), "alice", "m")
    with pytest.raises(PermissionError):
        check_owner(Caller(user="bob", uid=1001), None, "m")


async def test_only_the_owner_stops_or_scales(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    alice, bob = Caller(user="alice", uid=1000), Caller(user="bob", uid=1001)
    await service.serve(ServeRequest(model=str(model_dir)), alice)
    assert service.store.get_deployment("m").owner == "alice"
    with pytest.raises(PermissionError):
        await service.stop("m", bob)
    with pytest.raises(PermissionError):
        await service.stop("m-0", bob)
    with pytest.raises(PermissionError):
        await service.scale("m", 2, bob)
    assert slurm.cancelled == [] and len(slurm.submitted) == 1
    await service.stop("m", alice)
    assert slurm.cancelled == slurm.submitted
    # The engine's secret reaches the proxy's routing table, never the sbatch script.
    row = service.store.replica("m-0")
    assert (
        row.engine_secret
        and row.engine_secret not in Path(str(row.replica_dir), "job.sbatch").read_text()
    )
    secret_file = Path(str(row.replica_dir), "engine_secret")
    assert secret_file.read_text() == row.engine_secret
    assert secret_file.stat().st_mode & 0o777 == 0o600


# -- the replica's guard ------------------------------------------------------------------------


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization"):
            return web.json_response({"leak": "authorization reached the engine"}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_the_guard_refuses_without_the_secret_and_streams_with_it(upstream: str) -> None:
    guard = EngineGuard("s3cret", upstream)
    await guard.start("127.0.0.1", 0)
    assert guard.runner is not None
    port = guard.runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with s.post(url, json={}, headers=headers) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"
            async with s.post(url, json={}, headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200
                assert await resp.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    finally:
        await guard.stop()
    assert bearer_ok("Bearer s3cret", "s3cret") and not bearer_ok(None, "s3cret")


async def _guard_answer(upstream: str, ending: asyncio.Event | None = None) -> tuple[int, str]:
    guard = EngineGuard("s3cret", upstream, ending=ending)
    await guard.start("127.0.0.1", 0)
    assert guard.runner is not None
    url = f"http://127.0.0.1:{guard.runner.addresses[0][1]}/v1/chat/completions"
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, json={}, headers={"Authorization": "Bearer s3cret"}) as resp,
        ):
            return resp.status, (await resp.json())["error"]["code"]
    finally:
        await guard.stop()


async def test_the_guard_tells_an_engine_not_listening_from_one_that_broke_under_the_request() -> (
    None
):
    """Not listening: 503, the gateway may try another replica. Took the request and closed
    the connection without an answer: 502, never sent elsewhere (it may be what killed it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens on it once closed
    assert await _guard_answer(f"http://127.0.0.1:{closed_port}") == (503, "engine_unavailable")

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request reached the engine
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        answer = await _guard_answer(f"http://127.0.0.1:{port}")
        # The agent's job not ending (its engine died on its own): still the 502, after the
        # moment the guard gives the job's SIGTERM to arrive.
        alive = await _guard_answer(f"http://127.0.0.1:{port}", asyncio.Event())
    finally:
        server.close()
    assert answer == alive == (502, "engine_connection_broken")


async def test_a_connection_the_engine_breaks_as_its_job_ends_may_go_to_another_replica() -> None:
    """Slurm signals the engine and the agent together (a requeue, a cancel, a preemption):
    the engine may break a request's connection a moment before the agent learns that its job
    ends. Then the guard answers 503 (the gateway sends the request elsewhere), not the 502 of
    a request that may have broken the engine."""
    ending = asyncio.Event()

    async def killed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()  # the engine, killed with its job
        asyncio.get_running_loop().call_later(0.2, ending.set)  # the agent's SIGTERM, later

    server = await asyncio.start_server(killed, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        answer = await _guard_answer(f"http://127.0.0.1:{port}", ending)
    finally:
        server.close()
    assert answer == (503, "replica_stopping")
