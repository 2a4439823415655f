"""The Python API against a stand-in broker on the unix socket: the request it sends, its waits,
its errors, and the proxy address it gives the openai SDK. (The real broker, engine and proxy:
tests/cluster/test_python_api.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import xhpc
from tests.unit.test_cli_client import serving
from xhpc.client.control import Client
from xhpc.client.http import BrokerTransport
from xhpc.errors import ValidationError, XhpcError
from xhpc.settings import XhpcConfig


def _config(tmp_path: Path, **proxy: object) -> XhpcConfig:
    return XhpcConfig.model_validate(
        {"state_dir": str(tmp_path / "state"), "proxy": {"auth": "none", **proxy}}
    )


AT = "2026-01-01T00:00:00Z"


def _replica(rid: str, state: str) -> dict[str, Any]:
    return {
        "replica_id": rid,
        "deployment": "m",
        "index": int(rid.rsplit("-", 1)[1]),
        "state": state,
        "engine": "transformers",
        "created_at": AT,
        "updated_at": AT,
    }


def _view(*states: str, routed: bool = True) -> bytes:
    replicas = [_replica(f"m-{i}", s) for i, s in enumerate(states)]
    view = {"name": "m", "model": "m", "model_path": "/m", "engine": "transformers", "gpus": 1}
    return json.dumps({**view, "replicas": replicas, "routed": routed}).encode()


class Broker:
    """Answers a serve, then READY after ``polls`` looks, then a stop."""

    def __init__(self, *final: str, polls: int = 2, routed_after: int = 0) -> None:
        self.final = final
        self.polls = polls
        self.routed_after = routed_after
        self.looks = 0
        self.stopped = False

    def __call__(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/v1/serve":
            return 200, _view("QUEUED")
        if path == "/v1/deployments/m":
            self.looks += 1
            if self.stopped:
                return 200, _view("STOPPED")
            if self.looks < self.polls:
                return 200, _view("STARTING")
            return 200, _view(*self.final, routed=self.looks >= self.routed_after)
        if path == "/v1/stop":
            self.stopped = True
            return 200, json.dumps([_replica("m-0", "DRAINING")]).encode()
        if path.startswith("/v1/replicas"):
            return 200, json.dumps([_replica("m-0", "STOPPED")]).encode()
        return 404, b'{"error": {"code": "not_found", "message": "no"}}'


def test_serve_waits_for_ready_and_routed_and_stops_at_the_end(tmp_path: Path) -> None:
    cfg = _config(tmp_path, host="127.0.0.1", port=8123)
    broker = Broker("READY", routed_after=4)
    with serving(tmp_path / "state", broker) as server:
        with xhpc.serve("m", engine="transformers", config=cfg) as dep:
            assert broker.looks >= 4  # READY alone was not enough: it waited for routed
            assert dep.base_url == "http://127.0.0.1:8123/v1" and dep.api_key == "unused"
            sent = json.loads(next(b for m, p, _, b in server.seen if p == "/v1/serve"))
            assert sent["model"] == "m" and sent["engine"] == "transformers"
        assert broker.stopped  # leaving the block stopped it
        assert [p for m, p, _, _ in server.seen].count("/v1/stop") == 1


def test_keep_and_connect_leave_it_running(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    broker = Broker("READY")
    with serving(tmp_path / "state", broker):
        with xhpc.serve("m", keep=True, config=cfg):
            pass
        with xhpc.connect("m", config=cfg) as dep:
            assert dep.status().name == "m"
    assert not broker.stopped


def test_a_failed_replica_raises_and_the_deployment_is_stopped(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    broker = Broker("FAILED")
    with serving(tmp_path / "state", broker), pytest.raises(XhpcError, match="m-0 is FAILED"):
        xhpc.serve("m", config=cfg)
    assert broker.stopped


def test_bad_arguments_name_the_keyword_and_send_nothing(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with serving(tmp_path / "state", Broker("READY")) as server:
        with pytest.raises(ValidationError, match="replicas= must be at least 1"):
            xhpc.serve("m", replicas=0, config=cfg)
        with pytest.raises(ValidationError, match=r"time=: .*invalid time limit"):
            xhpc.serve("m", time="soon", config=cfg)
        assert server.seen == []


def test_keys_on_needs_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(xhpc.api.API_KEY_ENV, raising=False)
    cfg = XhpcConfig.model_validate({"state_dir": str(tmp_path / "state")})  # auth = keys
    with serving(tmp_path / "state", Broker("READY")):
        with pytest.raises(XhpcError, match="wants an API key"):
            xhpc.connect("m", config=cfg)
        assert xhpc.connect("m", api_key="xhpc-k", config=cfg).api_key == "xhpc-k"
        monkeypatch.setenv(xhpc.api.API_KEY_ENV, "xhpc-env")
        assert xhpc.connect("m", config=cfg).api_key == "xhpc-env"


def test_the_proxy_address_seen_from_a_job(tmp_path: Path) -> None:
    """Over TCP (a job): a proxy on every address is reached where the broker was; one on
    loopback is out of reach and says so."""
    state = tmp_path / "state"
    state.mkdir()
    transport = BrokerTransport.over_tcp("http://10.77.0.1:4000", "t", state / "broker.sock")
    client = Client.over(transport)
    wide = xhpc.api._deployment(client, "m", _config(tmp_path, host="0.0.0.0"), None, keep=True)
    assert wide.base_url.startswith("http://10.77.0.1:")
    with pytest.raises(XhpcError, match="cannot reach"):
        xhpc.api._deployment(client, "m", _config(tmp_path, host="127.0.0.1"), None, keep=True)


def test_the_package_loads_the_api_on_first_use() -> None:
    assert xhpc.serve is xhpc.api.serve and xhpc.Deployment is xhpc.api.Deployment
    with pytest.raises(AttributeError):
        _ = xhpc.no_such_thing
