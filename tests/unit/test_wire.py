"""Components of two versions together (xhpc.wire): a message a newer component sent, with
fields this version does not know, is read (they are ignored, at any depth); what a person
typed stays strict; a client sends no defaults, so an older broker reads a newer client's
plain request; a caller of a wire version the broker no longer serves gets a 426 that says
what to upgrade, and every answer names the broker's version."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import make
from xhpc.broker.api import agent_app, control_app
from xhpc.models import NodeInfo, ProxyLoad, RoutingTable, ServeRequest
from xhpc.wire import WIRE_HEADER, WIRE_VERSION, peer_wire, read, read_json, request_json


def test_a_newer_components_message_is_read_without_its_new_fields() -> None:
    table = {
        "version": 3,
        "epoch": 2,
        "a_field_of_a_later_version": {"x": 1},
        "routes": [
            {"replica_id": "r-1", "model": "m", "url": "http://10.0.0.1:9000",
             "served_model": "m", "secret": "s", "later": True}
        ],
    }  # fmt: skip
    got = read(RoutingTable, table)
    assert got.version == 3 and got.epoch == 2
    assert [r.replica_id for r in got.routes] == ["r-1"]
    with pytest.raises(pydantic.ValidationError):  # the strict reading refuses it
        RoutingTable.model_validate(table)
    load = read_json(ProxyLoad, json.dumps({"proxy_id": "p", "table_version": 1, "new": 0}))
    assert load.proxy_id == "p"


def test_a_persons_request_stays_strict() -> None:
    with pytest.raises(pydantic.ValidationError, match="replicaz"):
        ServeRequest.model_validate({"model": "m", "replicaz": 2})


def test_a_client_sends_only_what_differs_from_the_defaults() -> None:
    req = ServeRequest(model="tiny-llama", replicas=2)
    sent = json.loads(request_json(req))
    assert sent == {"model": "tiny-llama", "replicas": 2}
    assert ServeRequest.model_validate_json(request_json(req)) == req  # the broker's reading


@pytest.mark.adversarial
@pytest.mark.parametrize("value", ["x", "-1", "1.5", "9" * 40, ""])
def test_a_wire_header_that_is_not_a_version_is_none(value: str) -> None:
    assert peer_wire(value) is None
    assert peer_wire(None) == 1 and peer_wire(" 2 ") == 2


@pytest.fixture
async def apps(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> AsyncIterator[tuple[TestClient, TestClient]]:  # type: ignore[type-arg]
    service, _ = make(tmp_path, idle_nodes)
    async with (
        TestClient(TestServer(control_app(service))) as control,
        TestClient(TestServer(agent_app(service))) as agent,
    ):
        yield control, agent


@pytest.mark.adversarial
async def test_the_broker_refuses_a_wire_version_it_no_longer_serves_and_names_its_own(
    apps: tuple[TestClient, TestClient],  # type: ignore[type-arg]
) -> None:
    control, agent = apps
    resp = await control.get("/v1/health")  # no header: a component of before the header
    assert resp.status == 200 and resp.headers[WIRE_HEADER] == str(WIRE_VERSION)
    resp = await control.get("/v1/health", headers={WIRE_HEADER: str(WIRE_VERSION + 5)})
    assert resp.status == 200  # a newer caller knows what this broker understands
    for bad in ("0", "abc"):
        for client, path in ((control, "/v1/deployments"), (agent, "/agent/v1/report")):
            resp = await client.post(path, data=b"{}", headers={WIRE_HEADER: bad})
            body = await resp.json()
            assert resp.status == 426, body
            assert body["error"]["code"] == "upgrade_required"
            assert resp.headers[WIRE_HEADER] == str(WIRE_VERSION)
    resp = await control.get("/v1/health", headers={WIRE_HEADER: "0"})
    assert "upgrade it" in (await resp.json())["error"]["message"]
