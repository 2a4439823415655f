"""The relay of a standby broker to the leader on another login node (xhpc.broker.relay), on
real sockets: the leader's control API over TCP on loopback, the relay on a Unix socket, a real
SQLite state. What a caller gets through it, and what a job of the broker's user (which holds
the control token), a replayer, or a process that took the leader's port gets: nothing."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import free_port
from tests.unit.test_broker_service import make
from xhpc.broker.api import MAX_CONTROL_BODY, control_app
from xhpc.broker.relay import (
    ANSWER_HEADER,
    RELAY_HEADER,
    WINDOW_S,
    RelayKey,
    body_digest,
    relay_app,
)
from xhpc.broker.service import BrokerService
from xhpc.client.control import Client
from xhpc.errors import BrokerUnavailableError
from xhpc.models import NodeInfo, ProxyLoad, ServeRequest
from xhpc.paths import host_socket_path, reachable_socket
from xhpc.peers import user_name
from xhpc.proxy import broker_call
from xhpc.store import Store
from xhpc.store.secrets import shared_secret

pytestmark = pytest.mark.adversarial

TOKEN = "the-control-token-jobs-hold"


@dataclass
class Pair:
    service: BrokerService
    state: Path
    leader_url: str
    key: RelayKey
    relay_sock: Path  # the standby's socket for this login node

    def point_at(self, url: str, relay: bool = True) -> None:
        found = {"control_url": url, "relay": relay, "pid": 1}
        (self.state / "broker.json").write_text(json.dumps(found))


async def _serve_tcp(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def pair(tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path) -> AsyncIterator[Pair]:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    key = RelayKey(shared_secret(service.store, "relay"))
    leader, url = await _serve_tcp(control_app(service, remote_token=TOKEN, relay_key=key))
    state = tmp_path / "shared-state"
    state.mkdir()
    sock = host_socket_path(state / "broker.sock")
    relay = web.AppRunner(relay_app(state / "broker.json", key, MAX_CONTROL_BODY))
    await relay.setup()
    await web.UnixSite(relay, str(sock)).start()
    found = Pair(service, state, url, key, sock)
    found.point_at(url)
    yield found
    await relay.cleanup()
    await leader.cleanup()


def test_the_state_keeps_one_relay_key_for_every_broker(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    first = shared_secret(Store(db), "relay")
    assert len(first) == 64 and shared_secret(Store(db), "relay") == first
    assert shared_secret(Store(db), "other") != first


async def test_a_caller_on_this_login_node_reaches_the_leader_through_the_relay(
    pair: Pair,
) -> None:
    # Clients prefer this login node's socket; the leader's (another host's) is not there.
    assert reachable_socket(pair.state / "broker.sock") == pair.relay_sock
    client = Client.of_state_dir(pair.state, timeout_s=10)
    deps = await asyncio.to_thread(client.deployments)
    assert [d.name for d in deps] == ["m"]
    # This process is the broker's user: admin and proxy, as on the leader's own socket.
    keys = await asyncio.to_thread(client.transport.get, "/v1/keys")
    assert keys == []
    load = ProxyLoad(proxy_id="p", table_version=0).model_dump_json().encode()
    answer = await broker_call.call(
        pair.state / "broker.sock", "POST", "/v1/proxy/sync", load, timeout_s=10
    )
    assert answer.status == 200 and answer.uid == os.getuid()
    assert [r["replica_id"] for r in json.loads(answer.body)["routes"]] == []  # none READY


def _signed(key: RelayKey, uid: int, method: str, target: str, body: bytes = b"",
            at: float | None = None) -> tuple[str, str]:  # fmt: skip
    nonce = secrets.token_hex(16)
    when = int(time.time() if at is None else at)
    mac = key.call_mac(uid, nonce, when, method, target, {}, body_digest(body))
    return f"{uid} {nonce} {when} {mac}", nonce


async def test_a_call_claiming_to_be_relayed_needs_the_states_key(pair: Pair) -> None:
    """A job holds the control token; with it, or without, it cannot name a uid (root's, an
    admin's) by writing the relay header: only the brokers' key signs one."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = pair.leader_url + "/v1/keys"
    wrong = RelayKey("a key that is not the state's")
    forged = [
        "0 n 1 x",
        "0",
        "",
        "abc def ghi jkl",
        "0 é 1 mac",
        _signed(wrong, 0, "GET", "/v1/keys")[0],
        _signed(pair.key, 0, "GET", "/v1/deployments")[0],  # signed for another path
        _signed(pair.key, 0, "GET", "/v1/keys", at=time.time() - 2 * WINDOW_S)[0],  # stale
    ]
    async with aiohttp.ClientSession() as session:
        for header in forged:
            for extra in ({}, auth):
                async with session.get(url, headers={RELAY_HEADER: header, **extra}) as resp:
                    text = await resp.text()
                    assert resp.status == 403, (header, resp.status, text)
                    assert json.loads(text)["error"]["code"] == "forbidden"
                    assert ANSWER_HEADER not in resp.headers and TOKEN not in text
        # Signed, but with another body than the one sent; then an acting header added.
        header, _ = _signed(pair.key, 0, "POST", "/v1/keys", b'{"user": "root"}')
        async with session.post(
            url, data=b'{"user": "alice"}', headers={RELAY_HEADER: header}
        ) as resp:
            assert resp.status == 403
        header, _ = _signed(pair.key, 0, "GET", "/v1/keys")
        acting = {RELAY_HEADER: header, "X-Xhpc-Acting-User": "alice"}
        async with session.get(url, headers=acting) as resp:
            assert resp.status == 403
        # The genuine call is answered and signed; sent again (read off the network), refused.
        header, nonce = _signed(pair.key, 0, "GET", "/v1/keys")
        async with session.get(url, headers={RELAY_HEADER: header}) as resp:
            body = await resp.read()
            assert resp.status == 200
            assert resp.headers[ANSWER_HEADER] == pair.key.answer_mac(nonce, 200, body)
        async with session.get(url, headers={RELAY_HEADER: header}) as resp:
            assert resp.status == 403 and "sent again" in await resp.text()


async def test_a_relayed_uid_has_that_users_rights_only(pair: Pair) -> None:
    # A member's uid (not the broker's user, not root): no keys, no engine secrets.
    member = 4242
    async with aiohttp.ClientSession() as session:
        for method, path in (("GET", "/v1/keys"), ("GET", "/v1/routes")):
            header, _ = _signed(pair.key, member, method, path)
            async with session.request(
                method, pair.leader_url + path, headers={RELAY_HEADER: header}
            ) as resp:
                assert resp.status == 403 and "uid4242" in await resp.text()
        header, _ = _signed(pair.key, member, "GET", "/v1/deployments")
        async with session.get(
            pair.leader_url + "/v1/deployments", headers={RELAY_HEADER: header}
        ) as resp:
            assert resp.status == 200


async def test_the_relay_passes_on_no_answer_the_leader_did_not_sign(pair: Pair) -> None:
    """The leader died and another process took its port: it answers a table of its own (an
    engine of its own, to read the lab's prompts). The relay answers 503, as for a leader
    down; the caller never sees the impostor's answer."""
    table = {"version": 99, "routes": [{"replica_id": "x", "url": "http://10.0.0.66:1"}]}
    seen: list[str] = []

    async def impostor(request: web.Request) -> web.Response:
        seen.append(request.headers.get(RELAY_HEADER, ""))
        return web.json_response(table, headers={ANSWER_HEADER: "0" * 64})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", impostor)
    runner, url = await _serve_tcp(app)
    try:
        pair.point_at(url)
        load = ProxyLoad(proxy_id="p", table_version=0).model_dump_json().encode()
        answer = await broker_call.call(
            pair.state / "broker.sock", "POST", "/v1/proxy/sync", load, timeout_s=10
        )
        assert answer.status == 503 and b"10.0.0.66" not in answer.body
        assert json.loads(answer.body)["error"]["code"] == "broker_unavailable"
        assert seen and pair.key._key.decode() not in seen[0]  # the key itself is never sent
    finally:
        await runner.cleanup()


async def test_a_leader_down_or_of_no_relay_is_a_broker_unavailable(pair: Pair) -> None:
    client = Client.of_state_dir(pair.state, timeout_s=10)
    pair.point_at(f"http://127.0.0.1:{free_port()}")  # nothing listens: the leader is down
    with pytest.raises(BrokerUnavailableError, match="cannot reach the leading broker"):
        await asyncio.to_thread(client.deployments)
    pair.point_at(pair.leader_url, relay=False)  # an older leader: no relay
    with pytest.raises(BrokerUnavailableError, match="takes no relayed calls"):
        await asyncio.to_thread(client.deployments)
    (pair.state / "broker.json").write_text("not json")
    with pytest.raises(BrokerUnavailableError, match="takes no relayed calls"):
        await asyncio.to_thread(client.deployments)


async def test_a_batch_input_streams_through_the_relay(pair: Pair, tmp_path: Path) -> None:
    line = json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": {}})
    lines = "\n".join(line.replace('"x"', f'"r{i}"') for i in range(40_000)) + "\n"
    upload = tmp_path / "input.jsonl"
    upload.write_text(lines)
    assert upload.stat().st_size > MAX_CONTROL_BODY  # over what is ever read whole
    client = Client.of_state_dir(pair.state, timeout_s=30)
    me = {"X-Xhpc-Acting-User": user_name(os.getuid())}  # the proxy's identity names a user
    made = await asyncio.to_thread(
        client.transport.request, "POST", "/v1/batch-inputs", None, me, upload
    )
    assert made["lines"] == 40_000 and made["bytes"] == upload.stat().st_size


def test_a_socket_of_this_login_node_left_by_a_killed_broker_is_passed_over(
    tmp_path: Path,
) -> None:
    """This node's broker was killed (its socket file stays) and the leader's socket answers
    (a broker of another login node on one kernel, as the dev cluster's): clients go there."""
    leader = tmp_path / "broker.sock"
    assert reachable_socket(leader) == leader  # no socket of this node: the leader's
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(host_socket_path(leader)))  # a file nobody listens on
    assert reachable_socket(leader) == leader
    host_socket_path(leader).unlink()
    with socket.socket(socket.AF_UNIX) as alive:
        alive.bind(str(host_socket_path(leader)))
        alive.listen(1)
        assert reachable_socket(leader) == host_socket_path(leader)
