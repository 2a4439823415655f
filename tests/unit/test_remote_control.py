"""The control API over TCP for jobs of the broker's user: the control token is required, the
caller is a member (no engine secrets, no keys), and the client finds it from the state
directory when the unix socket is out of reach (component tests, real SQLite and sockets)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import make
from xhpc.broker.api import control_app
from xhpc.client.control import Client
from xhpc.client.http import BrokerTransport
from xhpc.errors import BrokerError, BrokerUnavailableError, ValidationError
from xhpc.models import NodeInfo, ProxyLoad, ServeRequest

TOKEN = "s3cret-control-token"


async def test_a_tcp_call_needs_the_token_and_acts_as_a_member(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    async with TestClient(TestServer(control_app(service, remote_token=TOKEN))) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            resp = await client.get("/v1/deployments", headers=headers)
            body = await resp.json()
            assert resp.status == 403 and body["error"]["code"] == "forbidden"
            assert TOKEN not in json.dumps(body)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        resp = await client.get("/v1/deployments", headers=auth)
        assert resp.status == 200 and [d["name"] for d in await resp.json()] == ["m"]
        # a member: no routes with engine secrets, no keys, no orphans
        load = ProxyLoad(proxy_id="p", table_version=0)
        resp = await client.post("/v1/proxy/sync", data=load.model_dump_json(), headers=auth)
        assert resp.status == 403
        for path in ("/v1/keys", "/v1/orphans"):
            assert (await client.get(path, headers=auth)).status == 403


@pytest.fixture
async def tcp_broker(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> tuple[str, Path]:
    """A broker's control API over TCP on loopback, and a state directory that names it."""
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    runner = web.AppRunner(control_app(service, remote_token=TOKEN))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    state = tmp_path / "shared-state"
    state.mkdir()
    (state / "broker.json").write_text(json.dumps({"control_url": f"http://127.0.0.1:{port}"}))
    (state / "control.token").write_text(TOKEN + "\n")
    yield f"http://127.0.0.1:{port}", state  # type: ignore[misc]
    await runner.cleanup()


async def test_the_client_reaches_tcp_when_the_socket_is_out_of_reach(
    tcp_broker: tuple[str, Path],
) -> None:
    url, state = tcp_broker
    # A socket file nobody listens on (what a compute node sees of the login node's socket).
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(state / "broker.sock"))
    client = Client.of_state_dir(state, timeout_s=10)
    assert client.transport.where == url
    deps = await asyncio.to_thread(client.deployments)
    assert [d.name for d in deps] == ["m"]
    with pytest.raises(BrokerError, match="is for admins"):
        await asyncio.to_thread(client.transport.get, "/v1/keys")
    # A wrong token is refused, and never shown.
    wrong = BrokerTransport.over_tcp(url, "wrong", state / "broker.sock", timeout_s=10)
    with pytest.raises(BrokerError) as err:
        await asyncio.to_thread(wrong.get, "/v1/deployments")
    assert "wrong" not in str(err.value) and TOKEN not in str(err.value)


async def test_the_client_keeps_the_unix_socket_when_it_answers(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    (state / "broker.json").write_text(json.dumps({"control_url": "http://127.0.0.1:9"}))
    (state / "control.token").write_text(TOKEN)
    runner = web.AppRunner(web.Application())
    await runner.setup()
    await web.UnixSite(runner, str(state / "broker.sock")).start()
    try:
        assert Client.of_state_dir(state).transport.where == str(state / "broker.sock")
    finally:
        await runner.cleanup()


def test_no_broker_at_all_is_the_usual_error(tmp_path: Path) -> None:
    client = Client.of_state_dir(tmp_path)  # no socket, no broker.json
    with pytest.raises(BrokerUnavailableError, match="not running"):
        client.deployments()


def test_bad_addresses_and_tokens_are_refused(tmp_path: Path) -> None:
    sock = tmp_path / "broker.sock"
    for url in ("ftp://h:1", "http://h", "not a url"):
        with pytest.raises(ValidationError):
            BrokerTransport.over_tcp(url, TOKEN, sock)
    for token in ("", "two words", "line\nbreak"):
        with pytest.raises(ValidationError):
            BrokerTransport.over_tcp("http://127.0.0.1:1", token, sock)
