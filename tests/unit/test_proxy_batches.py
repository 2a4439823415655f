"""The Batch API on the proxy with the openai SDK: files uploaded per key's user, a batch created
through the real control API of a broker (its Slurm recorded), its counts, cancel, results, and
another user's key seeing none of it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from yarl import URL

from tests.unit.test_broker_service import RecordingSlurm
from xhpc.access import Grants, KeyCreate
from xhpc.batch.lines import ProgressFile
from xhpc.batch.spec import progress_path
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.models import NodeInfo
from xhpc.proxy.app import make_app
from xhpc.proxy.batch_api.batches import BatchFront, FileStore
from xhpc.proxy.errors import clipped
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.settings import ModelEntry, ProxyConfig, XhpcConfig
from xhpc.store import Store


def lines(model: str, n: int) -> bytes:
    out = []
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]}
        out.append(json.dumps({"custom_id": f"c{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}))  # fmt: skip
    return ("\n".join(out) + "\n").encode()


class Gateway:
    def __init__(
        self, url: str, service: BrokerService, keys: dict[str, str], root: Path, book: KeyBook
    ) -> None:
        self.url, self.service, self.keys, self.root, self.book = url, service, keys, root, book

    def client(self, who: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[who], max_retries=0)


@pytest.fixture
async def gateway(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> AsyncIterator[Gateway]:
    # "m" in the site's catalog: what a key's batch names (never a path).
    config = XhpcConfig(state_dir=tmp_path / "state", models={"m": ModelEntry(path=model_dir)})
    store = Store(tmp_path / "state" / "x.db")
    service = BrokerService(config, store, RecordingSlurm(idle_nodes, store))
    shared = Path(tempfile.mkdtemp(prefix="xhpc-b-", dir="/tmp"))  # a short socket path
    sock = shared / "broker.sock"
    control = web.AppRunner(control_app(service), access_log=None)
    await control.setup()
    await web.UnixSite(control, str(sock)).start()
    keys = {user: service.keys.create(KeyCreate(user=user))[1] for user in ("ann", "bob")}
    book = KeyBook()
    book.update(Grants(keys=tuple(service.keys.grants())))
    front = BatchFront(FileStore(tmp_path / "files"), sock, book, catalog=("m",))
    app = make_app(Router(config=ProxyConfig()), keys=book, extra_routes=front.routes)
    proxy = web.AppRunner(app, access_log=None)
    await proxy.setup()
    site = web.TCPSite(proxy, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Gateway(f"http://127.0.0.1:{port}", service, keys, model_dir, book)
    finally:
        await proxy.cleanup()
        await control.cleanup()
        shutil.rmtree(shared, ignore_errors=True)


async def test_a_batch_through_the_proxy_with_the_openai_sdk(gateway: Gateway) -> None:
    ann, bob = gateway.client("ann"), gateway.client("bob")
    model = "m"  # the catalog's
    uploaded = await ann.files.create(file=("in.jsonl", lines(model, 3)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(lines(model, 3))
    assert (await ann.files.content(uploaded.id)).content == lines(model, 3)
    assert [f.id for f in (await ann.files.list()).data] == [uploaded.id]
    assert (await bob.files.list()).data == []
    with pytest.raises(openai.NotFoundError):
        await bob.files.retrieve(uploaded.id)

    batch = await ann.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"xhpc_shards": "2", "xhpc_gpus": "1", "run": "eval-1"},
    )  # fmt: skip
    assert batch.status == "in_progress" and batch.input_file_id == uploaded.id
    assert batch.request_counts is not None and batch.request_counts.total == 3
    assert batch.metadata == {"run": "eval-1"}
    view = gateway.service.batches.get(batch.id, None)
    assert view.owner == "ann" and view.shards == 2  # the key's user, not the proxy's
    # Another user's batch is, to bob, a batch that does not exist: not a 403 naming its owner.
    with pytest.raises(openai.NotFoundError) as nope:
        await bob.batches.retrieve(batch.id)
    assert "ann" not in str(nope.value)
    assert [b.id for b in (await ann.batches.list()).data] == [batch.id]
    assert (await bob.batches.list()).data == []

    # One line answered, then cancelled: the partial results come back as the output file.
    path = gateway.service.config.resolved_state_dir / "batches" / batch.id
    progress = ProgressFile(progress_path(path, 0))
    progress.add(0, True, {"custom_id": "c0", "response": {"status_code": 200}})
    progress.close()
    assert (await ann.batches.retrieve(batch.id)).request_counts.completed == 1  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        await bob.batches.cancel(batch.id)
    assert (await ann.batches.cancel(batch.id)).status == "cancelling"
    await gateway.service.batches.refresh([])
    done = await ann.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.output_file_id and done.error_file_id
    out = (await ann.files.content(done.output_file_id)).content.decode()
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["c0"]
    with pytest.raises(openai.NotFoundError):
        await bob.files.content(done.output_file_id)
    assert (await ann.files.delete(uploaded.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await ann.files.content(uploaded.id)


async def test_bad_batches_get_openai_shaped_errors(gateway: Gateway) -> None:
    ann = gateway.client("ann")
    mixed = lines("a", 1) + lines("b", 1)
    two_models = await ann.files.create(file=("m.jsonl", mixed), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="same model"):
        await ann.batches.create(input_file_id=two_models.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        await ann.batches.create(
            input_file_id="file-" + "0" * 24,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await ann.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    no_key = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await no_key.files.list()
    unknown = await ann.files.create(file=("u.jsonl", lines("no-such-model", 1)), purpose="batch")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await ann.batches.create(input_file_id=unknown.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    await asyncio.sleep(0)
    assert gateway.service.batches.all(None) == []
    assert os.path.isdir(gateway.service.config.resolved_state_dir)


@pytest.mark.adversarial
@pytest.mark.security
async def test_a_batch_id_never_steers_the_gateway_s_call_to_the_broker(gateway: Gateway) -> None:
    """Failed on 6d94085 before the fix: the gateway pasted the decoded batch id into the
    broker's URL, and the broker took the gateway for an admin: bob's key revoked ann's key
    (``POST /v1/batches/..%2Fkeys%2FKEY%2Frevoke%3F/cancel``) and read ann's batch
    (``GET /v1/batches/ID%3Fowner%3Dann``)."""
    ann_key = gateway.service.keys.all()[0]
    assert ann_key.user == "ann"
    model = "m"
    ann = gateway.client("ann")
    uploaded = await ann.files.create(file=("in.jsonl", lines(model, 1)), purpose="batch")
    batch = await ann.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    bob = {"Authorization": f"Bearer {gateway.keys['bob']}"}
    hostile = [
        ("POST", f"/v1/batches/..%2Fkeys%2F{ann_key.key_id}%2Frevoke%3F/cancel"),
        ("POST", f"/v1/batches/..%2F..%2Fv1%2Fkeys%2F{ann_key.key_id}%2Frevoke%23/cancel"),
        ("GET", f"/v1/batches/{batch.id}%3Fowner%3Dann"),
        ("GET", f"/v1/batches/{batch.id}%3F"),
        ("GET", f"/v1/files/file-out-{batch.id}%3Fowner%3Dann/content"),
        ("GET", "/v1/files/..%2F..%2Fann%2Ffile-0/content"),
    ]
    answers = []
    async with aiohttp.ClientSession() as session:
        for method, path in hostile:
            url = URL(gateway.url + path, encoded=True)
            async with session.request(method, url, headers=bob) as resp:
                answers.append((path, resp.status, await resp.json()))
    assert [k.revoked_at for k in gateway.service.keys.all() if k.user == "ann"] == [None]
    for path, status, body in answers:
        assert status == 404, (path, body)
        assert body["error"]["code"] == "not_found" and "ann" not in json.dumps(body)
    assert gateway.service.batches.get(batch.id, None).status == "in_progress"


@pytest.mark.adversarial
@pytest.mark.security
async def test_a_key_batches_only_the_models_it_may_use_and_never_a_path(
    gateway: Gateway, tmp_path: Path
) -> None:
    """Failed on 6d94085 before the fix: a batch skipped the gateway's model access. Any path
    the broker's user could read was a model (another member's weights), with an oracle in the
    refusal ("no model at ..." or "permission denied"), and bob's online batch went to ann's
    deployment with its engine secret."""
    from xhpc.access import Grants, ModelAccess

    gateway.book.update(
        Grants(
            keys=tuple(gateway.service.keys.grants()),
            access=(ModelAccess(model="anns", owner="ann"), ModelAccess(model="bobs", owner="bob")),
        )
    )
    bob = gateway.client("bob")
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "config.json").write_text("{}")
    refused: list[str] = []
    for model, online in [
        (str(gateway.root), False),  # a readable model directory
        (str(secret_dir), False),
        (str(tmp_path / "nothing-here"), False),
        ("../models/m", False),
        ("anns", False),  # ann's deployment, offline or online
        ("anns", True),
        ("m", True),  # a catalog name is no deployment
        ("no-such-model", False),
    ]:
        f = await bob.files.create(file=("in.jsonl", lines(model, 1)), purpose="batch")
        meta = {"xhpc_online": "true"} if online else {}
        with pytest.raises(openai.NotFoundError) as info:
            await bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata=meta)  # fmt: skip
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found", body
        refused.append(str(body["message"]).replace(repr(clipped(model)), "MODEL"))
    assert set(refused) == {"model MODEL does not exist"}  # one answer, whatever is on disk
    assert gateway.service.batches.all(None) == []

    ok = await bob.files.create(file=("in.jsonl", lines("m", 1)), purpose="batch")
    batch = await bob.batches.create(input_file_id=ok.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")  # fmt: skip
    assert gateway.service.batches.get(batch.id, None).owner == "bob"


@pytest.mark.adversarial
@pytest.mark.security
async def test_a_batch_spends_its_key_s_rate_slots_and_quota_and_its_tokens_count(
    gateway: Gateway,
) -> None:
    """Failed on 6d94085 before the fix: a batch skipped the key's limits (rpm,
    max_concurrent, token quota) and its answers' tokens were never counted for the key."""
    from xhpc.access import Grants, UsageCount

    service = gateway.service
    limited = {
        "carl": KeyCreate(user="carl", rpm=2),
        "dora": KeyCreate(user="dora", token_quota=10),
        "eve": KeyCreate(user="eve", max_concurrent=1),
    }
    ids = {}
    for who, req in limited.items():
        view, gateway.keys[who] = service.keys.create(req)
        ids[who] = view.key_id
    service.keys.add_usage({ids["dora"]: {"m": UsageCount(prompt_tokens=6, completion_tokens=4)}})
    gateway.book.update(Grants(keys=tuple(service.keys.grants())))

    async def create(who: str) -> str:
        client = gateway.client(who)
        f = await client.files.create(file=("in.jsonl", lines("m", 1)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")  # fmt: skip
        return batch.id

    await create("carl")
    await create("carl")  # the files calls are reads: only the creations spend the rate
    with pytest.raises(openai.RateLimitError, match="2 requests per minute"):
        await create("carl")
    with pytest.raises(openai.RateLimitError, match="token quota of 10 used up"):
        await create("dora")
    eve = gateway.book.grants[ids["eve"]]
    chat = gateway.book.enter(eve)  # a chat request of eve's in flight
    with pytest.raises(openai.RateLimitError, match="1 concurrent requests"):
        await create("eve")
    gateway.book.holds.release(chat)  # type: ignore[arg-type]
    await create("eve")
    assert sorted(v.owner for v in service.batches.all(None)) == ["carl", "carl", "eve"]

    # The tokens its answers used are the key's, once the batch ends.
    batch_id = await create("ann")
    path = service.config.resolved_state_dir / "batches" / batch_id
    progress = ProgressFile(progress_path(path, 0))
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    answer = {"status_code": 200, "body": {"usage": usage, "choices": []}}
    progress.add(0, True, {"custom_id": "c0", "response": answer})
    progress.close()
    await service.batches.refresh([])
    assert service.batches.get(batch_id, None).status == "completed"
    ann_key = next(k.key_id for k in service.keys.all() if k.user == "ann")
    (line,) = [u for u in service.keys.usage() if u.key_id == ann_key]
    assert (line.model, line.requests, line.prompt_tokens, line.completion_tokens) == (
        "m", 1, 5, 7,
    )  # fmt: skip
    # Its array is a run of ann's for the GPU-hours of `xhpc usage`.
    charge = {c.run: c for c in service.batches.charges()}[f"batch-{batch_id}"]
    assert (charge.owner, charge.model) == ("ann", "m") and charge.ended_at is not None
