"""The rest of the OpenAI-style surface through the gateway (``xhpc.endpoints``): responses,
tokenize and detokenize, rerank and score, before fake engines on loopback that answer as vLLM
does. Each takes the same admission, routing and usage accounting as chat; a responses stream is
relayed byte for byte (typed events, no ``[DONE]`` added, no usage options injected); a path the
model's engine lacks is an OpenAI-shaped 404 that names the engine. (The transparency against a
real vLLM engine: tests/cluster/test_surface.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tests.proxy_fakes import Stack, assert_openai_error, open_stack, serve
from tests.test_proxy_gateway import parse_metrics, value
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.models import EngineKind, PdRole, Route, RoutingTable
from xhpc.proxy.tenants.keys import KeyBook

RESPONSE_USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 16,
}


def typed(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **obj}).encode() + b"\n\n"


class SurfaceEngine:
    """What vLLM answers on the paths beyond chat and completions (``lacks``: paths it does
    not serve, answered as its web framework does)."""

    def __init__(self, name: str, lacks: tuple[str, ...] = ()) -> None:
        self.name = name
        self.lacks = lacks
        self.received: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/responses", "/tokenize", "/detokenize", "/v1/rerank", "/rerank",
                     "/v2/rerank", "/v1/score", "/score"):  # fmt: skip
            if path not in self.lacks:
                app.router.add_post(path, self.answer)
        return app

    def stream(self, model: str) -> list[bytes]:
        head = {"id": "resp_1", "object": "response", "model": model, "status": "in_progress"}
        done = {**head, "status": "completed", "usage": RESPONSE_USAGE}
        return [
            typed("response.created", {"sequence_number": 0, "response": head}),
            typed("response.output_text.delta", {"sequence_number": 1, "delta": "Hi"}),
            typed("response.completed", {"sequence_number": 2, "response": done}),
        ]

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        self.received.append((request.path, body))
        model = body["model"]
        if model not in ("/models/m", "a1"):
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": 404}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        path = request.path
        if path == "/v1/responses" and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in self.stream(model):
                await resp.write(event)
            await resp.write_eof()
            return resp
        if path == "/v1/responses":
            text = {"type": "output_text", "text": f"hi from {self.name}"}
            out = [{"type": "message", "role": "assistant", "content": [text]}]
            return web.json_response({"id": "resp_1", "object": "response", "model": model,
                                      "output": out, "usage": RESPONSE_USAGE})  # fmt: skip
        if path == "/tokenize":
            return web.json_response({"count": 3, "max_model_len": 512, "tokens": [1, 2, 3]})
        if path == "/detokenize":
            return web.json_response({"prompt": "a b c"})
        if path.endswith("rerank"):
            results = [{"index": 0, "relevance_score": 0.5, "document": {"text": "d"}}]
            return web.json_response({"id": "rerank-1", "model": model, "results": results,
                                      "usage": {"total_tokens": 9}})  # fmt: skip
        data = [{"index": 0, "object": "score", "score": 0.25}]
        return web.json_response({"id": "score-1", "object": "list", "model": model, "data": data,
                                  "usage": {"prompt_tokens": 7, "total_tokens": 7}})  # fmt: skip


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


async def engine(
    s: Stack, rid: str, engine_kind: EngineKind, model: str = "m", **kw: Any
) -> SurfaceEngine:
    fake = SurfaceEngine(rid, **kw)
    url = await s.exits.enter_async_context(serve(fake.app()))
    s.routes[rid] = Route(
        model=model, replica_id=rid, url=url, served_model=f"/models/{model}", engine=engine_kind
    )
    return fake


async def post(
    s: Stack, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with s.client.post(s.url + path, data=json.dumps(body).encode(), headers=headers) as r:
        return r.status, await r.read()


BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {"input": "hi", "max_output_tokens": 5},
    "/tokenize": {"prompt": "a b c"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/rerank": {"query": "q", "documents": ["d"]},
    "/rerank": {"query": "q", "documents": ["d"]},
    "/v2/rerank": {"query": "q", "documents": ["d"]},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/score": {"text_1": "a", "text_2": "b"},
}


async def test_each_path_reaches_the_engine_with_its_served_name_and_comes_back_renamed(
    stack: Stack,
) -> None:
    fake = await engine(stack, "a", EngineKind.VLLM)
    stack.publish("a")
    for path, extra in BODIES.items():
        status, raw = await post(stack, path, {"model": "m", **extra})
        assert status == 200, (path, raw)
        sent_path, sent = fake.received[-1]
        assert sent_path == path and sent == {"model": "/models/m", **extra}  # nothing else
        answer = json.loads(raw)
        assert "/models/m" not in raw.decode()  # the engine's path never reaches the client
        if "model" in answer:
            assert answer["model"] == "m"
    samples = parse_metrics(await stack.metrics())
    assert value(samples, "xhpc_proxy_requests_total", model="m", replica="a", status="200") == 8


async def test_a_responses_stream_is_relayed_byte_for_byte_without_done_or_usage_options(
    stack: Stack,
) -> None:
    fake = await engine(stack, "a", EngineKind.VLLM)
    stack.publish("a")
    status, raw = await post(stack, "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    assert status == 200
    sent = fake.received[-1][1]
    assert "stream_options" not in sent  # responses streams have no usage chunk to ask for
    expected = b"".join(fake.stream("/models/m")).replace(b'"/models/m"', b'"m"')
    assert raw == expected  # every typed event as the engine wrote it; no [DONE] added
    samples = parse_metrics(await stack.metrics())
    assert not value(samples, "xhpc_proxy_stream_errors_total", model="m", replica="a",
                     kind="unterminated")  # fmt: skip


async def test_usage_of_responses_and_rerank_is_counted_and_their_budgets_reserved(
    stack: Stack,
) -> None:
    await engine(stack, "a", EngineKind.VLLM)
    stack.publish("a")
    key_id, key, digest = new_key()
    grant = KeyGrant(key_id=key_id, digest=digest, user="carol", token_quota=1000)
    book = KeyBook()
    book.update(Grants(keys=(grant,), access=(ModelAccess(model="m", owner="carol"),)))
    await stack.start_proxy(keys=book)
    auth = {"Authorization": f"Bearer {key}"}
    for stream in (False, True):
        body = {"model": "m", "input": "hi", "max_output_tokens": 5, "stream": stream}
        assert (await post(stack, "/v1/responses", body, auth))[0] == 200
    assert (await post(stack, "/v1/rerank", {"model": "m", **BODIES["/v1/rerank"]}, auth))[0] == 200
    assert (await post(stack, "/tokenize", {"model": "m", "prompt": "x"}, auth))[0] == 200
    # 2 x (11 in + 5 out) for the responses; rerank counts 9 (its total); tokenize nothing
    assert book.unsent_tokens[grant.key_id] == 2 * 16 + 9
    assert book.holds.reserved == {}
    book.update(Grants(keys=(grant.model_copy(update={"token_quota": 41}),),
                       access=(ModelAccess(model="m", owner="carol"),)))  # fmt: skip
    for path in ("/v1/responses", "/tokenize"):  # used up: every path is refused
        status, raw = await post(stack, path, {"model": "m", **BODIES[path]}, auth)
        assert status == 429, (path, raw)
        assert_openai_error(json.loads(raw), "insufficient_quota")


async def test_another_users_model_does_not_exist_on_any_path(stack: Stack) -> None:
    fake = await engine(stack, "a", EngineKind.VLLM)
    stack.publish("a")
    ann_id, _, ann_digest = new_key()
    bob_id, bob_key, bob_digest = new_key()
    book = KeyBook()
    keys = (KeyGrant(key_id=ann_id, digest=ann_digest, user="ann"),
            KeyGrant(key_id=bob_id, digest=bob_digest, user="bob"))  # fmt: skip
    book.update(Grants(keys=keys, access=(ModelAccess(model="m", owner="ann"),)))
    await stack.start_proxy(keys=book)
    for path, extra in BODIES.items():
        status, raw = await post(
            stack, path, {"model": "m", **extra}, {"Authorization": f"Bearer {bob_key}"}
        )
        assert status == 404, (path, raw)
        assert_openai_error(json.loads(raw), "model_not_found")
        status, raw = await post(stack, path, {"model": "m", **extra})  # no key at all
        assert status == 401, (path, raw)
    assert fake.received == []


async def test_a_path_the_engine_lacks_is_a_404_that_names_the_engine(stack: Stack) -> None:
    await engine(stack, "a", EngineKind.TRANSFORMERS, lacks=("/tokenize", "/v1/rerank"))
    stack.publish("a")
    for path in ("/tokenize", "/v1/rerank"):
        status, raw = await post(stack, path, {"model": "m", **BODIES[path]})
        assert status == 404
        body = json.loads(raw)
        assert_openai_error(body, "endpoint_not_served")
        message = body["error"]["message"]
        assert message == f"model 'm' is served by transformers, which does not serve POST {path}"
    # The engine's own OpenAI 404 (a model it does not know) passes as it is.
    stack.routes["b"] = stack.routes["a"].model_copy(
        update={"replica_id": "b", "model": "n", "served_model": "/models/n"}
    )
    stack.publish("b")
    status, raw = await post(stack, "/detokenize", {"model": "n", "tokens": [1]})
    assert status == 404 and json.loads(raw)["error"]["type"] == "NotFoundError"


async def test_a_pd_model_serves_chat_and_completions_only(stack: Stack) -> None:
    await engine(stack, "p", EngineKind.VLLM)
    await engine(stack, "d", EngineKind.VLLM)
    routes = tuple(
        stack.routes[r].model_copy(update={"role": role, "unit": "u"})
        for r, role in (("p", PdRole.PREFILL), ("d", PdRole.DECODE))
    )
    stack.router.update(RoutingTable(version=7, models=("m",), routes=routes))
    for path in ("/v1/responses", "/tokenize", "/score"):
        status, raw = await post(stack, path, {"model": "m", **BODIES[path]})
        assert status == 400, (path, raw)
        assert_openai_error(json.loads(raw), "unsupported_endpoint")


async def test_an_adapter_is_a_model_of_its_own_that_names_its_parent(stack: Stack) -> None:
    """A LoRA adapter's routes are its base's replicas under the adapter's name: requests
    name the adapter to the engine, and /v1/models lists it with its parent."""
    fake = await engine(stack, "a", EngineKind.VLLM)
    adapter = stack.routes["a"].model_copy(update={"model": "a1", "served_model": "a1"})
    routes = (stack.routes["a"], adapter)
    stack.router.update(
        RoutingTable(version=3, models=("a1", "m"), routes=routes, parents={"a1": "m"})
    )
    status, _ = await post(stack, "/tokenize", {"model": "a1", "prompt": "x"})
    assert status == 200 and fake.received[-1][1]["model"] == "a1"  # the engine's LoRA name
    async with stack.client.get(stack.url + "/v1/models") as resp:
        listed = {m["id"]: m for m in (await resp.json())["data"]}
    assert listed["a1"]["parent"] == "m" and "parent" not in listed["m"]
