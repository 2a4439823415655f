"""The gateway's ``/metrics`` with its brokers' part (``xhpc.proxy.broker_metrics``): a real
broker (real SQLite, the recording Slurm stand-in, its control API on a Unix socket) scrapes a
fake vLLM engine, and the gateway shows that engine's series labelled with its deployment,
replica, job and node, beside its own; a broker that does not answer (down, too slow, an
error, too large an answer) is ``xhpc_broker_up 0`` and the gateway's own figures are served
all the same; a lab gateway labels each broker's series with its member; a broker's text never
writes the gateway's own families; a key that is not an admin's gets no metrics at all."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.proxy_fakes import FakeEngine, assert_openai_error, eventually, serve
from tests.test_proxy_exposure import get, keys
from tests.test_proxy_gateway import value
from tests.unit.test_keeper import make, running, slurm
from tests.unit.test_prometheus_text import parse_metrics
from xhpc.broker.api import control_app
from xhpc.broker.outlook import overview
from xhpc.models import AgentRegistration, EngineKind, NodeInfo, Route, RoutingTable, ServeRequest
from xhpc.peers import user_name
from xhpc.proxy import Router, make_app
from xhpc.proxy.app import make_metrics_app
from xhpc.proxy.broker_metrics import BrokerSections
from xhpc.slurm.parse import parse_sinfo_json

DATA = Path(__file__).resolve().parent / "data" / "slurm"

BROKER_TEXT = """\
# HELP xhpc_broker_replicas Active replicas per deployment and state.
# TYPE xhpc_broker_replicas gauge
xhpc_broker_replicas{deployment="m",state="READY"} 1
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{deployment="m",replica="m-0",job="7",node="n1"} 2
"""


class FakeBroker:
    """A broker's ``GET /v1/metrics`` on a Unix socket: ``text`` with ``status``, after
    ``delay_s``; counts the calls."""

    def __init__(self, text: str = BROKER_TEXT, status: int = 200, delay_s: float = 0.0) -> None:
        self.text, self.status, self.delay_s = text, status, delay_s
        self.calls = 0

    def app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            return web.Response(text=self.text, status=self.status)

        app = web.Application()
        app.router.add_get("/v1/metrics", metrics)
        return app


@pytest.fixture
def idle_nodes() -> list[NodeInfo]:
    return parse_sinfo_json((DATA / "sinfo-idle.json").read_text())


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "m"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def routed(router: Router) -> Router:
    route = Route(model="m", replica_id="m-0", url="http://127.0.0.1:9", served_model="/m")
    router.update(RoutingTable(version=1, models=("m",), routes=(route,)))
    return router


async def test_the_gateway_shows_an_engine_s_series_labelled_where_it_runs(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path, client: aiohttp.ClientSession
) -> None:
    service = make(tmp_path, idle_nodes)
    # A fixed deployment (no scaling policy): its engine is scraped all the same.
    await service.serve(ServeRequest(model=str(model_dir), engine=EngineKind.VLLM))
    engine = FakeEngine("m-0")
    sock = tmp_path / "broker.sock"
    async with serve(engine.app()) as engine_url, serve(control_app(service), unix_path=sock):
        port = int(engine_url.rsplit(":", 1)[1])
        slurm(service).queue = [running("100", node="n1")]
        await service.reconcile_once()  # job running; its agent registers: READY
        reg = AgentRegistration(replica_id="m-0", job_id="100", node="n1", host="127.0.0.1",
                                port=port, served_model="m")  # fmt: skip
        service.agents.register(reg)
        await service.reconcile_once()  # the scrape, in the background
        await eventually(lambda: "m-0" in service.autoscaler.engines.scrapes)
        # `xhpc top` and `xhpc ps` get the engine's own queue and KV cache on its outlook.
        (shown,) = service.replicas()
        assert shown.outlook is not None
        assert (shown.outlook.engine_running, shown.outlook.engine_waiting) == (2, 5)
        assert shown.outlook.kv_use == 0.42
        (seen,) = (await overview(service, 0)).outlook
        assert (seen.engine_running, seen.kv_use) == (2, 0.42)

        app = make_app(routed(Router()), brokers=BrokerSections([sock]))
        async with serve(app) as url:
            status, text = await get(client, url + "/metrics")
    assert status == 200
    samples = parse_metrics(text)
    assert value(samples, "xhpc_broker_up") == 1
    assert value(samples, "xhpc_proxy_ready_replicas", model="m") == 1
    assert value(samples, "xhpc_broker_replicas", deployment="m", state="READY") == 1
    assert value(samples, "xhpc_broker_queue_wait_seconds_count", deployment="m") == 1
    where = {"deployment": "m", "replica": "m-0", "job": "100", "node": "n1", "engine": "0"}
    assert value(samples, "vllm:num_requests_waiting", **where, model_name="/models/m") == 5
    assert value(samples, "vllm:prompt_tokens_total", **where, model_name="/models/m") == 1234
    age = value(samples, "xhpc_broker_engine_scrape_age_seconds", deployment="m", replica="m-0")
    assert 0 <= age < 60
    await service.autoscaler.close()


async def test_a_broker_that_does_not_answer_is_down_and_the_gateway_serves_its_own(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    slow, failing, large = (
        FakeBroker(delay_s=1.5),
        FakeBroker(status=500),
        FakeBroker("x 1\n" * 999),
    )
    cases = (
        (tmp_path / "nobody.sock", None, {}),
        (tmp_path / "slow.sock", slow, {"timeout_s": 0.3}),
        (tmp_path / "failing.sock", failing, {}),
        (tmp_path / "large.sock", large, {"max_bytes": 1000}),
    )
    for sock, broker, limits in cases:
        router = routed(Router())
        sections = BrokerSections([sock], **limits)
        gateway = make_metrics_app(make_app(router, brokers=sections))
        async with (
            serve(broker.app() if broker else web.Application(), unix_path=sock),
            serve(gateway) as url,
        ):
            status, text = await get(client, url + "/metrics")
        assert status == 200, sock
        samples = parse_metrics(text)
        assert "xhpc_broker_up 0\n" in text, sock
        assert value(samples, "xhpc_proxy_ready_replicas", model="m") == 1, sock
        names = {name for name, _ in samples}
        assert names - {"xhpc_broker_up"} == {n for n in names if n.startswith("xhpc_proxy_")}


@pytest.mark.adversarial
async def test_a_key_that_is_not_an_admin_s_gets_no_metrics_and_the_broker_is_not_asked(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    broker, sock = FakeBroker(), tmp_path / "broker.sock"
    book, auth = keys()
    app = make_app(routed(Router()), keys=book, brokers=BrokerSections([sock]))
    async with serve(broker.app(), unix_path=sock), serve(app) as url:
        for presented, status_wanted, code in ((None, 401, "invalid_api_key"),
                                               (auth["alice"], 403, "forbidden")):  # fmt: skip
            status, text = await get(client, url + "/metrics", presented)
            assert status == status_wanted
            assert_openai_error(json.loads(text), code)
            assert "xhpc_broker" not in text and "vllm" not in text
        assert broker.calls == 0
        status, text = await get(client, url + "/metrics", auth["root"])
        assert status == 200 and broker.calls == 1
        samples = parse_metrics(text)
        assert value(samples, "vllm:num_requests_running", deployment="m", replica="m-0",
                     job="7", node="n1") == 2  # fmt: skip


@pytest.mark.adversarial
async def test_a_lab_gateway_labels_each_member_s_series_and_keeps_its_own_families(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    hostile = (
        BROKER_TEXT
        + "xhpc_broker_up 1\n"  # the gateway's own
        + '# TYPE xhpc_proxy_requests_total counter\nxhpc_proxy_requests_total{model="m"} 1e9\n'
        + 'vllm:num_requests_running{member="me",deployment="a"} 1\n'
        + "# TYPE vllm:num_requests_running counter\n"  # a second TYPE: ignored
        + "garbage {{{\n"
    )
    a, b, down = FakeBroker(), FakeBroker(hostile), tmp_path / "down.sock"
    socks = [tmp_path / "a.sock", tmp_path / "b.sock", down]
    sections = BrokerSections(socks)
    app = make_app(routed(Router()), brokers=sections)
    async with (
        serve(a.app(), unix_path=socks[0]),
        serve(b.app(), unix_path=socks[1]),
        serve(app) as url,
    ):
        status, text = await get(client, url + "/metrics")
    assert status == 200
    samples = parse_metrics(text)
    me = user_name(os.getuid())  # both brokers run as this test's user: the second is told apart
    first, second = me, f"{me} ({socks[1]})"
    assert value(samples, "xhpc_broker_up", broker=str(socks[0]), member=first) == 1
    assert value(samples, "xhpc_broker_up", broker=str(socks[1]), member=second) == 1
    assert value(samples, "xhpc_broker_up", broker=str(down), member="") == 0
    for member in (first, second):
        assert value(samples, "xhpc_broker_replicas", member=member, deployment="m",
                     state="READY") == 1  # fmt: skip
    assert value(samples, "vllm:num_requests_running", member=second, exported_member="me",
                 deployment="a") == 1  # fmt: skip
    assert text.count("# TYPE xhpc_broker_replicas gauge") == 1
    assert text.count("# TYPE xhpc_broker_up ") == 1 and "1e9" not in text
    assert "1000000000" not in text  # the hostile broker's proxy counter is not the gateway's
