"""What the gateway shows: /metrics only to admin keys (or on its own listener), the public
model name in every answer (never an engine's filesystem path), and no client string echoed
back at any length."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.proxy_fakes import FakeEngine, Stack, assert_openai_error, chat, open_stack, serve
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.config import XhpcConfig
from xhpc.models import Route
from xhpc.proxy import make_app
from xhpc.proxy.app import make_metrics_app
from xhpc.proxy.engines.contexts import BODY_MARGIN_BYTES
from xhpc.proxy.process.server import bound_url, metrics_runner
from xhpc.proxy.relay.answers import Renamer, UsageStrip, renamer
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.settings import ProxyConfig

pytestmark = pytest.mark.security


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        await s.engine("a")
        s.publish("a")
        yield s


def keys() -> tuple[KeyBook, dict[str, str]]:
    book, presented, grants = KeyBook(), {}, []
    for user, admin in (("root", True), ("alice", False)):
        key_id, key, digest = new_key()
        grants.append(KeyGrant(key_id=key_id, digest=digest, user=user, admin=admin))
        presented[user] = f"Bearer {key}"
    book.update(Grants(keys=tuple(grants), access=(ModelAccess(model="m", owner="alice"),)))
    return book, presented


async def get(client: aiohttp.ClientSession, url: str, auth: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": auth} if auth else None
    async with client.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


# --- /metrics ---


async def test_metrics_need_an_admin_key_when_keys_are_on(stack: Stack) -> None:
    book, auth = keys()
    await stack.start_proxy(keys=book)
    url = stack.url + "/metrics"
    status, text = await get(stack.client, url)
    assert status == 401
    assert_openai_error(json.loads(text), "invalid_api_key")
    status, text = await get(stack.client, url, auth["alice"])
    assert status == 403
    assert_openai_error(json.loads(text), "forbidden")
    assert json.loads(text)["error"]["type"] == "permission_error"
    status, text = await get(stack.client, url, auth["root"])
    assert status == 200 and "xhpc_proxy_ready_replicas" in text


async def test_metrics_without_keys_stay_open(stack: Stack) -> None:
    assert "xhpc_proxy_ready_replicas" in await stack.metrics()


async def test_the_metrics_listener_needs_no_key_and_serves_nothing_else(stack: Stack) -> None:
    book, _ = keys()
    app = make_app(stack.router, keys=book)
    async with serve(make_metrics_app(app)) as url:
        status, text = await get(stack.client, url + "/metrics")
        assert status == 200 and 'xhpc_proxy_ready_replicas{model="m"} 1' in text
        status, text = await get(stack.client, url + "/v1/models")
        assert status == 404
        assert_openai_error(json.loads(text), "not_found")


async def test_metrics_listen_binds_its_own_address(stack: Stack) -> None:
    config = XhpcConfig(proxy=ProxyConfig(metrics_listen="127.0.0.1:0"))
    app = make_app(stack.router, keys=keys()[0])
    runner = await metrics_runner(app, config)
    assert runner is not None
    try:
        status, text = await get(stack.client, bound_url(runner) + "/metrics")
        assert status == 200 and "xhpc_proxy_requests_total" in text
    finally:
        await runner.cleanup()
    assert await metrics_runner(app, XhpcConfig()) is None


def test_metrics_listen_is_host_and_port() -> None:
    assert ProxyConfig(metrics_listen="[::1]:9100").metrics_address == ("::1", 9100)
    for bad in ("9100", "host:", ":9100", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="host:port"):
            ProxyConfig(metrics_listen=bad)


# --- the public model name ---


async def test_answers_name_the_public_model_never_the_engine_path(stack: Stack) -> None:
    status, _, body = await stack.post("/v1/chat/completions", chat())
    assert status == 200 and body["model"] == "m"
    status, _, body = await stack.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 200 and body["model"] == "m"
    status, _, body = await stack.post("/v1/embeddings", {"model": "m", "input": "x"})
    assert status == 200 and body["model"] == "m"
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200 and b"/models/m" not in raw
    assert raw == b"".join(FakeEngine.stream_chunks("m"))
    assert {r["model"] for r in stack.engines["a"].received} == {"/models/m"}


async def test_an_engine_that_uses_the_public_name_is_relayed_byte_exact(stack: Stack) -> None:
    engine = stack.engines["a"]
    stack.routes["a"] = stack.routes["a"].model_copy(update={"served_model": "m"})
    stack.publish("a")
    status, raw = await stack.stream(chat(stream=True, stream_options={"include_usage": True}))
    assert status == 200 and raw == engine.sent
    assert renamer("m", "m") is None


def test_the_renamer_touches_only_model_members() -> None:
    rename = Renamer("/p/é", "pub")
    assert rename(b'{"model":"/p/\\u00e9","x":1}') == b'{"model":"pub","x":1}'
    assert rename('{"model" : "/p/é"}'.encode()) == b'{"model" : "pub"}'
    text = b'{"content":"say \\"model\\": \\"/p/\\u00e9\\"","model":"other"}'
    assert rename(text) == text  # a name in generated text, another model: untouched
    assert rename(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_only_usage_only_chunks_are_stripped() -> None:
    usage_only = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    last = b'data: {"choices":[{"index":0}],"usage":{"prompt_tokens":1}}\n\n'  # transformers
    done = b"data: [DONE]\n\n"
    assert UsageStrip().feed(last + usage_only + done) == last + done
    assert UsageStrip().feed(usage_only.replace(b"\n\n", b"\r\n\r\n") + done) == done
    null = b'data: {"choices":[],"usage":null}\n\n'
    assert UsageStrip().feed(null) == null


async def test_every_answer_names_the_replica_that_answered(stack: Stack) -> None:
    await stack.engine("b")
    stack.publish("a", "b")
    seen = set()
    for _ in range(6):
        status, headers, body = await stack.post("/v1/chat/completions", chat())
        assert status == 200
        replica = headers["X-Xhpc-Replica"]
        assert body["choices"][0]["message"]["content"] == f"hello from {replica}"
        seen.add(replica)
    assert seen == {"a", "b"}
    url = stack.url + "/v1/chat/completions"
    async with stack.client.post(url, json=chat(stream=True)) as resp:
        assert resp.status == 200 and resp.headers["X-Xhpc-Replica"] in {"a", "b"}
        await resp.read()


async def test_models_show_the_engines_context_length_under_the_public_name(stack: Stack) -> None:
    async with stack.client.get(stack.url + "/v1/models") as resp:
        (entry,) = (await resp.json())["data"]
    assert entry["id"] == entry["root"] == "m" and "max_model_len" not in entry  # not stated
    await stack.engine("b")
    for rid, length in (("a", 2048), ("b", 1024)):
        stack.routes[rid] = stack.routes[rid].model_copy(update={"max_model_len": length})
    stack.publish("a", "b")
    async with stack.client.get(stack.url + "/v1/models/m") as resp:
        entry = await resp.json()
    assert entry["max_model_len"] == 1024  # what every replica takes
    assert "/models/" not in json.dumps(entry)


async def test_a_body_no_prompt_in_the_context_could_need_is_refused_before_the_engine(
    stack: Stack,
) -> None:
    stack.routes["a"] = stack.routes["a"].model_copy(update={"max_model_len": 100})
    stack.publish("a")
    limit = 100 * ProxyConfig().bytes_per_context_token + BODY_MARGIN_BYTES
    fits = chat(messages=[{"role": "user", "content": "x" * (limit - 200)}])
    status, _, body = await stack.post("/v1/chat/completions", fits)
    assert status == 200, body
    over = chat(messages=[{"role": "user", "content": "x" * (limit + 1)}])
    status, _, body = await stack.post("/v1/chat/completions", over)
    assert status == 400
    assert_openai_error(body, "context_length_exceeded")
    assert "context of 100 tokens" in body["error"]["message"]
    assert len(stack.engines["a"].received) == 1  # only the one that fits


# --- no client string echoed at any length ---


async def test_a_huge_model_name_is_not_echoed_back(stack: Stack) -> None:
    name = "n" * 100_000
    status, _, body = await stack.post("/v1/chat/completions", chat(name))
    assert status == 404
    assert_openai_error(body, "model_not_found")
    message = body["error"]["message"]
    assert len(message) < 300 and "n" * 64 in message and "n" * 65 not in message
    async with stack.client.get(stack.url + "/v1/models/" + name[:4000]) as resp:
        assert resp.status == 404
        assert len((await resp.json())["error"]["message"]) < 300


async def test_an_unknown_path_is_not_echoed_at_length(stack: Stack) -> None:
    async with stack.client.get(stack.url + "/x" * 3000) as resp:
        assert resp.status == 404
        assert len((await resp.json())["error"]["message"]) < 400


def test_a_route_whose_names_differ_gets_a_renamer() -> None:
    route = Route(model="m", replica_id="a", url="http://x", served_model="/models/m")
    rename = renamer(route.served_model, route.model)
    assert rename is not None and rename is renamer("/models/m", "m")  # cached
