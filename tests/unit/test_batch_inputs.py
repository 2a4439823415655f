"""The control API keeps small bodies; a batch's input streams to its own endpoint, into an
owner-only file within the site's caps on bytes and lines, each line checked to be JSON, and
``POST /v1/batches`` names it by id. The CLI's client streams the file (never whole in memory)."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import RecordingSlurm
from xhpc.batch.spec import BatchRequest
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.client.control import Client
from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import NodeInfo
from xhpc.peers import user_name
from xhpc.settings import BrokerConfig, ModelEntry, XhpcConfig
from xhpc.store import Store

pytestmark = pytest.mark.security
MAX_BYTES, MAX_LINES = 4096, 10


def request_line(cid: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": cid}]}
    return json.dumps({"custom_id": cid, "url": "/v1/chat/completions", "body": body})


@dataclass
class Broker:
    service: BrokerService
    client: Client
    inputs: Path


@pytest.fixture
def service(tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path) -> BrokerService:
    broker = BrokerConfig(batch_input_max_bytes=MAX_BYTES, batch_input_max_lines=MAX_LINES)
    config = XhpcConfig(
        state_dir=tmp_path / "state", broker=broker, models={"m": ModelEntry(path=model_dir)}
    )
    store = Store(tmp_path / "state" / "x.db")
    return BrokerService(config, store, RecordingSlurm(idle_nodes, store))


@pytest.fixture
async def broker(service: BrokerService) -> AsyncIterator[Broker]:
    shared = Path(tempfile.mkdtemp(prefix="xhpc-in-", dir="/tmp"))  # a short socket path
    runner = web.AppRunner(control_app(service), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(shared / "b.sock")).start()
    try:
        inputs = service.config.resolved_state_dir / "batch-inputs"
        yield Broker(service, Client(shared / "b.sock", timeout_s=20), inputs)
    finally:
        await runner.cleanup()
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.adversarial
async def test_every_control_call_but_the_upload_keeps_a_small_body(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    """Failed on 6d94085 before the fix: every control endpoint read bodies up to 256 MiB (a
    22 MB batch input froze the broker for 27 s and grew it by 860 MB)."""
    store = Store(tmp_path / "state" / "x.db")
    config = XhpcConfig(state_dir=tmp_path / "state")  # the site's defaults
    service = BrokerService(config, store, RecordingSlurm(idle_nodes, store))
    big = json.dumps({"model": "m", "input": "x" * (2 << 20)})
    async with TestClient(TestServer(control_app(service))) as http:
        for path in ("/v1/batches", "/v1/serve", "/v1/keys", "/v1/stop"):
            resp = await http.post(path, data=big)
            assert resp.status == 413, (path, await resp.text())
        lines = "\n".join(request_line(f"q{i}") for i in range(3)) + "\n"
        resp = await http.post("/v1/batch-inputs", data=lines * 4000)  # 1.8 MB: streamed
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["lines"] == 12000


async def test_a_chunked_input_is_cut_off_at_the_cap(broker: Broker) -> None:
    async def endless() -> AsyncIterator[bytes]:  # chunked: no Content-Length to check
        for _ in range(1000):
            yield b"{}\n" * 100

    async with TestClient(TestServer(control_app(broker.service))) as http:
        resp = await http.post("/v1/batch-inputs", data=endless())
        assert resp.status == 400 and "limit of 4096 bytes" in await resp.text()
    assert not broker.inputs.exists() or not [p for p in broker.inputs.rglob("*") if p.is_file()]


async def test_an_input_streams_to_an_owner_only_file_and_a_batch_names_it(
    broker: Broker, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(request_line(f"q{i}") for i in range(MAX_LINES)) + "\n\n")
    input_id = await asyncio.to_thread(broker.client.upload_batch_input, path)
    me = user_name(__import__("os").getuid())
    stored = broker.inputs / me / f"{input_id}.jsonl"
    assert stored.read_text() == path.read_text()
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    view = await asyncio.to_thread(
        broker.client.create_batch, BatchRequest(model="m", input_id=input_id)
    )
    assert view.request_counts.total == MAX_LINES and view.owner == me
    assert not stored.exists()  # moved into the batch
    batch_dir = broker.service.config.resolved_state_dir / "batches" / view.id
    assert (batch_dir / "input.jsonl").read_text() == path.read_text()
    with pytest.raises(NotFoundError, match="no batch input"):  # taken once
        await asyncio.to_thread(
            broker.client.create_batch, BatchRequest(model="m", input_id=input_id)
        )
    theirs = broker.service.batches.inputs.save("ann", request_line("a"))
    with pytest.raises(NotFoundError, match="no batch input"):  # another user's
        await asyncio.to_thread(
            broker.client.create_batch, BatchRequest(model="m", input_id=theirs)
        )


async def test_an_input_over_a_cap_or_not_json_is_refused_and_nothing_is_kept(
    broker: Broker, tmp_path: Path
) -> None:
    """Refused as the CLI uploads it (the broker may answer before the whole file is sent)."""
    cases = {
        "over the broker's limit of 4096 bytes": "x" * 200 + "\n" + "{}\n" * 2000,
        "over the broker's limit of 10 lines": "{}\n" * 11,
        r"line 2, 4 of the input: not JSON": '{}\n{"a": \n{}\n\x00\n',
        "holds no requests": "\n \n",
    }
    for why, text in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(text)
        with pytest.raises(ValidationError, match=why):
            await asyncio.to_thread(broker.client.upload_batch_input, path)
    left = list(broker.inputs.rglob("*")) if broker.inputs.exists() else []
    assert [p for p in left if p.is_file()] == []
    with pytest.raises(ValidationError, match="cannot read"):
        await asyncio.to_thread(broker.client.upload_batch_input, tmp_path / "missing.jsonl")
