"""Properties of the gateway (the OpenAI-compatible proxy, API keys on) under another key: whatever
bob's key sends, the gateway answers without a 5xx and with OpenAI's error object on a 4xx, and
ann's files, batches, results, engine and key stay hers and unchanged.

The gateway (``make_app`` with the Batch API's routes, served by its own ``GatewayRunner``) and
the broker it runs batches on (a real
control socket; a Slurm that records every script) are served from a thread of this process.
Ann, a key's user, has a deployment (a fake engine behind a secret), uploaded files, and a batch
with metadata and results, all made through the gateway before any example. Hypothesis draws
bob's requests: file uploads (hostile purposes, file names and lines), file reads, deletes and
contents by hostile and real ids (ann's among them), batches created with hostile input files,
endpoints and ``xhpc_*`` metadata, batch reads and cancels, calls of every forwarded endpoint
(chat, responses, tokenize, rerank...) and model reads with hostile
model names, a few other paths and methods, and now and then another key or none. After each
answer: its status is under 500; a 4xx is OpenAI's error object; nothing planted of ann's is in
it (her file contents, metadata, results, engine secret, key), nor an id of hers bob did not
name; her files, batches and results are as they were; her engine got no request; and every
script the broker wrote passes ``tests.props_support.directive_problems``.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.props_support import (
    BackgroundLoop,
    CapturingSlurm,
    directive_problems,
    hostile_text,
    options,
)
from tests.proxy_fakes import FakeEngine
from xhpc.access import Grants, KeyCreate, ModelAccess
from xhpc.batch.lines import ProgressFile
from xhpc.batch.spec import progress_path
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.endpoints import ENDPOINTS
from xhpc.models import Route, RoutingTable
from xhpc.proxy.app import make_app
from xhpc.proxy.batch_api.batches import BatchFront
from xhpc.proxy.batch_api.files import FileLimits, FileStore
from xhpc.proxy.process.listener import GatewayRunner
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.proxy.tenants.limits import ClientLimits
from xhpc.settings import ModelEntry, ProxyConfig, XhpcConfig
from xhpc.slurm.parse import parse_sinfo_json
from xhpc.store import Store

pytestmark = [pytest.mark.security, pytest.mark.adversarial]

DATA = Path(__file__).resolve().parent / "data" / "slurm"
PROPS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ENGINE_SECRET = "ENGINE-SECRET-MARK-of-ann-s-replica"
BOUNDARY = "xhpc-props-boundary"


def line(model: str, cid: str = "q") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": body})  # fmt: skip


def multipart(fields: list[tuple[str, str | None, bytes]]) -> bytes:
    """A multipart/form-data body of (name, filename, content) parts."""
    out = b""
    for name, filename, content in fields:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += content + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def exchange(port: int, raw: bytes, method: str) -> tuple[int, str]:
    """``raw`` sent to the gateway on its own connection; the answer's status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        return resp.status, resp.read().decode("utf-8", "replace")


def request(method: str, path: str, key: str | None, body: bytes | None, ctype: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", "Connection: close"]
    if key is not None:
        lines.append(f"Authorization: {key}")
    if body is not None:
        lines += [f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


@dataclass
class Lab:
    loop: BackgroundLoop
    service: BrokerService
    slurm: CapturingSlurm
    files: FileStore
    engine: FakeEngine
    port: int
    keys: dict[str, str]  # user -> raw key
    ids: dict[str, str]  # placeholder -> real id
    secrets: list[str]  # never in an answer to bob
    ann_ids: list[str]  # in an answer to bob only once he named it
    named: set[str] = field(default_factory=set)
    checked_scripts: int = 0

    def call(self, method: str, path: str, key: str | None, body: bytes | None = None,
             ctype: str = "application/json") -> tuple[int, str]:  # fmt: skip
        return exchange(self.port, request(method, path, key, body, ctype), method)

    def ann_state(self) -> object:
        """Ann's files (objects and contents), batches and results."""

        async def read() -> object:
            files = self.files.all("ann")
            contents = [self.files.content("ann", f["id"]) for f in files]
            batches = [v.model_dump() for v in self.service.batches.all(None) if v.owner == "ann"]
            output = self.service.batches.output(self.ids["@ANN_BATCH@"], None)
            return files, contents, batches, output

        return self.loop.run(read())


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("props-gateway")
    model_dir = root / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    shared = Path(tempfile.mkdtemp(prefix="xhpc-props-gw-", dir="/tmp"))  # a short socket path
    sock = shared / "broker.sock"
    loop = BackgroundLoop()

    async def start() -> tuple[Any, ...]:
        # "m" in the site's catalog: what a key's batch names (never a path).
        config = XhpcConfig(state_dir=root / "state", models={"m": ModelEntry(path=model_dir)})
        store = Store(root / "state" / "x.db")
        slurm = CapturingSlurm(parse_sinfo_json((DATA / "sinfo-idle.json").read_text()), store)
        service = BrokerService(config, store, slurm)
        control = web.AppRunner(control_app(service), access_log=None)
        await control.setup()
        await web.UnixSite(control, str(sock)).start()
        keys = {u: service.keys.create(KeyCreate(user=u))[1] for u in ("ann", "bob")}
        engine = FakeEngine("anns-0")
        engine_runner = web.AppRunner(engine.app(), access_log=None)
        await engine_runner.setup()
        engine_site = web.TCPSite(engine_runner, "127.0.0.1", 0)
        await engine_site.start()
        engine_port = engine_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        router = Router(config=ProxyConfig())
        route = Route(model="anns", replica_id="anns-0", url=f"http://127.0.0.1:{engine_port}",
                      served_model="anns", secret=ENGINE_SECRET)  # fmt: skip
        router.update(RoutingTable(version=1, models=("anns",), routes=(route,)))
        book = KeyBook()
        book.update(Grants(keys=tuple(service.keys.grants()),
                           access=(ModelAccess(model="anns", owner="ann"),)))  # fmt: skip
        files = FileStore(root / "files", FileLimits(max_count=1000))
        front = BatchFront(files, sock, book, router=router, catalog=("m",))
        # The gateway's own runner: the HTTP layer's refusals are OpenAI-shaped too.
        app = make_app(router, keys=book, extra_routes=front.routes)
        proxy = GatewayRunner(app, ClientLimits(), shutdown_timeout_s=1.0)
        await proxy.setup()
        site = web.TCPSite(proxy, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return service, slurm, files, engine, port, keys, (control, engine_runner, proxy)

    service, slurm, files, engine, port, keys, runners = loop.run(start())
    lab = Lab(loop, service, slurm, files, engine, port, keys, {}, [], [])
    plant(lab)
    try:
        yield lab
    finally:

        async def stop() -> None:
            for runner in runners:
                await runner.cleanup()

        loop.run(stop())
        loop.close()
        shutil.rmtree(shared, ignore_errors=True)


def upload(lab: Lab, who: str, content: bytes, filename: str = "in.jsonl") -> str:
    body = multipart([("purpose", None, b"batch"), ("file", filename, content)])
    status, text = lab.call("POST", "/v1/files", f"Bearer {lab.keys[who]}", body,
                            f"multipart/form-data; boundary={BOUNDARY}")  # fmt: skip
    assert status == 200, text
    return str(json.loads(text)["id"])


def plant(lab: Lab) -> None:
    """Ann's files and a batch with results, and a file of bob's, made through the gateway."""
    ann = f"Bearer {lab.keys['ann']}"
    kept = upload(lab, "ann", (line("m", "ANN-FILE-MARK") + "\n").encode(), "ANN-NAME-MARK")
    used = upload(lab, "ann", (line("m") + "\n").encode())
    meta = {"note": "ANN-META-MARK", "xhpc_shards": "1"}
    body = json.dumps({"input_file_id": used, "endpoint": "/v1/chat/completions",
                       "completion_window": "24h", "metadata": meta}).encode()  # fmt: skip
    status, text = lab.call("POST", "/v1/batches", ann, body)
    assert status == 200, text
    batch = str(json.loads(text)["id"])

    async def finish() -> None:
        progress = ProgressFile(progress_path(lab.service.batches.root / batch, 0))
        progress.add(0, True, {"custom_id": "q", "response": {"body": "ANN-OUTPUT-MARK"}})
        progress.close()
        await lab.service.batches.cancel(batch, None)
        await lab.service.batches.refresh([])

    lab.loop.run(finish())
    assert "ANN-OUTPUT-MARK" in lab.service.batches.output(batch, None)
    bob_file = upload(lab, "bob", (line("m") + "\n").encode())
    bob_used = upload(lab, "bob", (line("m") + "\n").encode())
    body = json.dumps({"input_file_id": bob_used, "endpoint": "/v1/chat/completions",
                       "completion_window": "24h"}).encode()  # fmt: skip
    status, text = lab.call("POST", "/v1/batches", f"Bearer {lab.keys['bob']}", body)
    assert status == 200, text
    bob_batch = str(json.loads(text)["id"])
    lab.ids.update({"@ANN_FILE@": kept, "@ANN_USED_FILE@": used, "@ANN_BATCH@": batch,
                    "@BOB_FILE@": bob_file, "@BOB_BATCH@": bob_batch})  # fmt: skip
    grant = {g.user: g for g in lab.service.keys.grants()}["ann"]
    secret = lab.keys["ann"].split(".")[-1]
    lab.secrets += [ENGINE_SECRET, lab.keys["ann"], secret, grant.digest, "ANN-FILE-MARK",
                    "ANN-NAME-MARK", "ANN-META-MARK", "ANN-OUTPUT-MARK"]  # fmt: skip
    lab.ann_ids += [kept, used, batch]


# -- what bob sends ------------------------------------------------------------------------------
IDS = st.sampled_from(["@ANN_FILE@", "@ANN_USED_FILE@", "@ANN_BATCH@", "file-out-@ANN_BATCH@",
                       "file-err-@ANN_BATCH@", "@BOB_FILE@", "@BOB_BATCH@", "file-out-@BOB_BATCH@",
                       "file-" + "0" * 24,
                       "batch_" + "0" * 24])  # fmt: skip
ANY_ID = st.one_of(IDS, hostile_text())
MODELS = st.one_of(st.sampled_from(["anns", "m", "bobs", "@ANN_FILE@"]), hostile_text())
JSONL = st.one_of(
    st.lists(st.builds(line, MODELS, hostile_text()), min_size=1, max_size=3).map(
        lambda ls: ("\n".join(ls) + "\n").encode()
    ),
    st.binary(max_size=64),
    st.sampled_from([b"", b"\n", b"{}\n", b"[1]\n", b"\xff\xfe\n", b'{"a":' * 5000]),
)
XHPC_OPTIONS = ["xhpc_shards", "xhpc_gpus", "xhpc_engine", "xhpc_qos", "xhpc_partition",
                "xhpc_time", "xhpc_concurrency", "xhpc_online", "xhpc_input_file_id"]  # fmt: skip
VALID_METADATA = [{}, {"run": "x"}, {"xhpc_shards": "2"}, {"xhpc_partition": "gpu"},
                  {"xhpc_time": "30:00", "xhpc_qos": "normal"}, {"xhpc_gpus": "0"}]  # fmt: skip
METADATA = st.dictionaries(
    st.one_of(st.sampled_from(XHPC_OPTIONS), hostile_text()),
    st.one_of(st.sampled_from(["1", "0", "true", "gpu", "normal", "30:00", "-1"]), hostile_text()),
    max_size=3,
)
JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | hostile_text(),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(hostile_text(), inner, max_size=2),
    max_leaves=5,
)


MOSTLY = st.integers(0, 3)  # truthy three times in four


@dataclass
class Request:
    method: str
    route: str
    path: str
    body: bytes | None
    ctype: str
    key: str | None  # the Authorization header; "@BOB@": bob's key


def segment(value: str) -> str:
    return quote(value, safe="")


@st.composite
def requests(draw: st.DrawFn) -> Request:
    route = draw(st.sampled_from([
        "upload", "upload", "list files", "file", "delete file", "file content", "file content",
        "create batch", "create batch", "create batch", "list batches", "batch", "cancel batch",
        "chat", "chat", "models", "model", "other",
    ]))  # fmt: skip
    body: bytes | None = None
    ctype = "application/json"
    if route == "upload":
        method, path = "POST", "/v1/files"
        purpose = "batch" if draw(MOSTLY) else draw(hostile_text())
        filename = "in.jsonl" if draw(MOSTLY) else draw(hostile_text())
        filename = filename.replace('"', "").replace("\r", "").replace("\n", "")
        content = (line("m") + "\n").encode() if draw(MOSTLY) else draw(JSONL)
        parts = [("purpose", None, purpose.encode("utf-8", "replace")), ("file", filename, content)]
        body = multipart(draw(st.permutations(parts)) if draw(st.booleans()) else parts)
        ctype = f"multipart/form-data; boundary={BOUNDARY}"
        if not draw(MOSTLY):
            ctype = draw(st.sampled_from(["application/json", "multipart/form-data"]))
    elif route in ("file", "delete file", "file content"):
        method = "DELETE" if route == "delete file" else "GET"
        tail = "/content" if route == "file content" else ""
        path = f"/v1/files/{segment(draw(ANY_ID))}{tail}"
    elif route == "create batch":
        method, path = "POST", "/v1/batches"
        fields = {  # (valid, hostile)
            "input_file_id": (st.just("@BOB_FRESH_FILE@"), ANY_ID),
            "endpoint": (st.just("/v1/chat/completions"), st.sampled_from(["/v1/embeddings", "x"])),
            "completion_window": (st.just("24h"), hostile_text()),
            "metadata": (st.sampled_from(VALID_METADATA), METADATA),
        }
        hostile = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
        shaped = {k: draw(v[1] if k in hostile else v[0]) for k, v in fields.items()}
        body = json.dumps(shaped if draw(MOSTLY) else draw(JSON_ANY)).encode()
    elif route in ("batch", "cancel batch"):
        method = "POST" if route == "cancel batch" else "GET"
        tail = "/cancel" if route == "cancel batch" else ""
        path = f"/v1/batches/{segment(draw(ANY_ID))}{tail}"
    elif route == "chat":  # any forwarded endpoint: one admission for all of them
        method, path = "POST", draw(st.sampled_from(sorted(ENDPOINTS)))
        chat = {"model": draw(MODELS), "messages": [{"role": "user", "content": "hi"}],
                "input": "hi", "prompt": "hi", "query": "q", "documents": ["d"], "tokens": [1],
                "stream": draw(st.booleans())}  # fmt: skip
        body = json.dumps(draw(st.one_of(st.just(chat), JSON_ANY))).encode()
    elif route == "model":
        method, path = "GET", f"/v1/models/{segment(draw(MODELS))}"
    else:
        method, path = {
            "list files": ("GET", "/v1/files"),
            "list batches": ("GET", "/v1/batches"),
            "models": ("GET", "/v1/models"),
        }.get(route) or (
            draw(st.sampled_from(["PUT", "GET", "DELETE", "PATCH"])),
            "/" + "/".join(segment(draw(hostile_text())) for _ in range(2)),
        )
    key = draw(st.sampled_from(["@BOB@"] * 6 + [None, "Bearer xhpc-000000000000.nope", "Basic x"]))
    return Request(method, route, path, body, ctype, key)


def real(lab: Lab, text: str) -> str:
    if "@BOB_FRESH_FILE@" in text:
        text = text.replace("@BOB_FRESH_FILE@", upload(lab, "bob", (line("m") + "\n").encode()))
    for placeholder, value in lab.ids.items():
        text = text.replace(placeholder, value).replace(segment(placeholder), segment(value))
    return text


def openai_error(body: str) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    err = data.get("error") if isinstance(data, dict) else None
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
    )


@given(req=requests())
@PROPS
def test_another_key_gets_no_5xx_none_of_ann_s_things_and_changes_nothing_of_hers(
    lab: Lab, req: Request
) -> None:
    before = lab.ann_state()
    path = real(lab, req.path)
    body = None if req.body is None else real(lab, req.body.decode("utf-8", "surrogateescape"))
    payload = None if body is None else body.encode("utf-8", "surrogateescape")
    key = f"Bearer {lab.keys['bob']}" if req.key == "@BOB@" else req.key
    status, text = lab.call(req.method, path, key, payload, req.ctype)
    event(f"{req.route}: {status}")
    what = f"{req.method} {path[:200]} -> {status} {text[:300]}"
    assert 0 < status < 500, what
    if status >= 400:
        assert openai_error(text), what
    for secret in lab.secrets:
        assert secret not in text, f"{what}: a secret of ann's"
    lab.named.update(i for i in lab.ann_ids if i in path or i in (body or ""))
    for ann_id in lab.ann_ids:
        assert ann_id not in text or ann_id in lab.named, f"{what}: ann's {ann_id}"
    assert lab.ann_state() == before, what
    assert lab.engine.received == [], "bob's request reached ann's engine"
    scripts = lab.slurm.scripts[lab.checked_scripts :]
    lab.checked_scripts = len(lab.slurm.scripts)
    for script in scripts:
        assert directive_problems(script) == [], f"{what}\n{script}"
        assert_metadata_as_sent(script, body)


def assert_metadata_as_sent(script: str, body: str | None) -> None:
    """The partition, QoS and time limit a batch's ``xhpc_*`` metadata named stand on its
    script's lines as sent."""
    try:
        meta = json.loads(body or "").get("metadata") or {}
    except (ValueError, AttributeError):
        return
    lines = options(script)
    for option in ("partition", "qos", "time"):
        if f"xhpc_{option}" in meta:
            assert lines.get(f"--{option}") == str(meta[f"xhpc_{option}"]), script
