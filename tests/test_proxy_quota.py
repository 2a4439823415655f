"""Token quotas and concurrency caps at the gateway: every stream is counted (the proxy asks
the engine for its usage and takes the usage chunk out again for a client that did not ask),
each request reserves its output budget while it runs so that parallel requests overshoot a
quota by at most one request, and a key's requests in flight may be capped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.proxy_fakes import (
    DEADLINE_S,
    FakeEngine,
    Stack,
    assert_openai_error,
    chat,
    eventually,
    open_stack,
)
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.endpoints import ENDPOINTS
from xhpc.proxy.relay.answers import UsageStrip
from xhpc.proxy.relay.body import RequestBody
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.proxy.tenants.quota import output_budget

pytestmark = pytest.mark.security


def grant(**limits: int) -> tuple[str, KeyGrant]:
    key_id, key, digest = new_key()
    return key, KeyGrant(key_id=key_id, digest=digest, user="carol", **limits)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        await s.engine("a")
        s.publish("a")
        yield s


async def gate(stack: Stack, **limits: int) -> tuple[KeyBook, KeyGrant, dict[str, str]]:
    """Keys on, one key with ``limits`` that may use model "m"."""
    book = KeyBook()
    key, g = grant(**limits)
    book.update(Grants(keys=(g,), access=(ModelAccess(model="m", owner="carol"),)))
    await stack.start_proxy(keys=book)
    return book, g, {"Authorization": f"Bearer {key}"}


async def stream(stack: Stack, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    async with asyncio.timeout(DEADLINE_S):
        async with stack.client.post(
            stack.url + "/v1/chat/completions", data=data, headers=headers
        ) as resp:
            return resp.status, await resp.content.read()


def tokens_counted(book: KeyBook) -> int:
    return sum(
        c.prompt_tokens + c.completion_tokens
        for models in book.take_report("p").usage.values()
        for c in models.values()
    )


# --- every stream is counted ---


async def test_parallel_streams_overshoot_a_quota_by_one_request_at_most(stack: Stack) -> None:
    book, _, auth = await gate(stack, token_quota=5)
    engine = stack.engines["a"]
    results = await asyncio.gather(*(stream(stack, chat(stream=True), auth) for _ in range(20)))
    served = [raw for status, raw in results if status == 200]
    assert len(served) <= 1
    for status, raw in results:
        if status != 200:
            assert status == 429
            assert_openai_error(json.loads(raw), "insufficient_quota")
    # The stream was counted, though its client did not ask for usage...
    assert engine.received[0]["stream_options"] == {"include_usage": True}
    assert tokens_counted(book) == 5
    # ...and it looks exactly as it would have: no usage chunk, every other event as it was.
    assert served == [b"".join(FakeEngine.stream_chunks("m"))]
    assert book.holds.reserved == {}
    status, raw = await stream(stack, chat(stream=True), auth)
    assert status == 429  # the quota is used up now


async def test_a_client_that_asks_for_usage_gets_the_usage_chunk(stack: Stack) -> None:
    book, _, auth = await gate(stack, token_quota=1000)
    options = {"include_usage": True, "continuous_usage_stats": False}
    status, raw = await stream(stack, chat(stream=True, stream_options=options), auth)
    assert status == 200
    assert b'"usage": {"prompt_tokens": 3' in raw
    assert stack.engines["a"].received[0]["stream_options"] == options  # as the client sent it
    assert tokens_counted(book) == 5


async def test_streams_are_counted_without_keys_too(stack: Stack) -> None:
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200 and b'"usage"' not in raw
    text = await stack.metrics()
    assert 'xhpc_proxy_tokens_total{model="m",kind="completion"} 2' in text


FINGERPRINT = "vllm-0.32.0-1a2b3c4d"


def vllm_stream(model: str, asked: bool, choices: int = 1) -> list[bytes]:
    """A stream as vLLM 0.32 writes it: asked for usage, its terminal chunks lose their
    ``system_fingerprint`` to the usage chunk that follows them."""

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}
    out = []
    for i in range(choices):
        delta = {"index": i, "delta": {"content": f"hi{i}"}, "logprobs": None}
        out.append(event({**head, "choices": [{**delta, "finish_reason": None}]}))
        terminal: dict[str, Any] = {**head, "choices": [{**delta, "finish_reason": "stop"}]}
        if not asked:
            terminal["system_fingerprint"] = FINGERPRINT
        out.append(event(terminal))
    if asked:
        usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
        out.append(
            event({**head, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT})
        )
    return [*out, b"data: [DONE]\n\n"]


async def test_a_client_gets_the_stream_vllm_writes_when_not_asked_for_usage(
    stack: Stack,
) -> None:
    engine = stack.engines["a"]
    engine.script = vllm_stream("/models/m", asked=True)
    status, raw = await stack.stream(chat(stream=True))
    assert status == 200
    assert raw == b"".join(vllm_stream("m", asked=False))
    body = chat(stream=True, stream_options={"include_usage": True})
    assert (await stack.stream(body))[1] == b"".join(vllm_stream("m", asked=True))


def test_several_choices_get_their_fingerprints_back_in_order() -> None:
    strip = UsageStrip()
    out = b"".join(strip.feed(e) for e in vllm_stream("m", asked=True, choices=3))
    assert out == b"".join(vllm_stream("m", asked=False, choices=3))
    cut = vllm_stream("m", asked=True)[:2]  # the stream breaks after its terminal chunk
    assert b"".join(strip.feed(e) for e in cut) + strip.flush() == b"".join(cut)


def test_the_stream_options_sent_ask_for_one_usage_chunk() -> None:
    def sent(body: dict[str, Any], strict: bool = True) -> Any:
        raw = json.dumps(body).encode()
        if not strict:
            raw = raw.replace(b'"hi"', b'"hi", "x": NaN')  # decoded and re-encoded
        req = RequestBody(raw)
        return json.loads(req.upstream("/m", req.usage_options())).get("stream_options")

    for strict in (True, False):
        assert sent(chat(stream=True), strict) == {"include_usage": True}
        options = {"include_usage": False, "continuous_usage_stats": True}
        assert sent(chat(stream=True, stream_options=options), strict) == {"include_usage": True}
        asked = {"include_usage": "true", "continuous_usage_stats": True}
        assert sent(chat(stream=True, stream_options=asked), strict) == asked
        assert sent(chat(), strict) is None  # not a stream: the answer has its usage
        assert sent(chat(stream_options={"include_usage": False}), strict) == {
            "include_usage": False
        }


# --- reservations ---


async def test_parallel_requests_are_admitted_while_their_budgets_fit(stack: Stack) -> None:
    book, g, auth = await gate(stack, token_quota=100)
    engine = stack.engines["a"]
    engine.hold = asyncio.Event()
    body = chat(max_tokens=30)
    tasks = [asyncio.create_task(stack.post("/v1/chat/completions", body, auth)) for _ in range(6)]
    await eventually(lambda: len(engine.received) == 4)
    assert book.holds.reserved == {g.key_id: 120}  # 0, 30, 60, 90 left room; 120 did not
    engine.hold.set()
    statuses = sorted(r[0] for r in await asyncio.gather(*tasks))
    assert statuses == [200] * 4 + [429] * 2
    assert book.holds.reserved == {}
    assert book.unsent_tokens[g.key_id] == 4 * 6  # what the answers said, not the budgets


async def test_an_answer_without_usage_is_charged_its_reservation(stack: Stack) -> None:
    book, g, auth = await gate(stack, token_quota=1000)
    status, _, body = await stack.post(
        "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 7}, auth
    )
    assert status == 200 and "usage" not in body  # this engine counts nothing here
    assert book.unsent_tokens[g.key_id] == 7


async def test_a_client_leaving_before_the_usage_chunk_is_charged_its_reservation(
    stack: Stack,
) -> None:
    book, g, auth = await gate(stack, token_quota=1000)
    engine = stack.engines["a"]
    engine.between_chunks = asyncio.Event()
    data = json.dumps(chat(stream=True, max_completion_tokens=9)).encode()
    async with stack.client.post(
        stack.url + "/v1/chat/completions", data=data, headers=auth
    ) as resp:
        assert (await resp.content.readany()).startswith(b"data: ")
        resp.close()
    engine.between_chunks.set()
    await eventually(lambda: book.unsent_tokens[g.key_id] == 9)
    assert book.holds.reserved == {}


def test_the_output_budget() -> None:
    default = 1024

    def budget(path: str, body: dict[str, object]) -> int:
        bounds = [body.get(name) for name in ENDPOINTS[path].budget_fields]
        return output_budget(bounds, body.get("n"), default)

    chat = "/v1/chat/completions"
    assert budget(chat, {}) == 1024
    assert budget(chat, {"max_tokens": 10}) == 10
    assert budget(chat, {"max_tokens": 10, "max_completion_tokens": 20}) == 20
    assert budget(chat, {"max_tokens": 10, "n": 3}) == 30
    assert budget(chat, {"max_tokens": True, "max_completion_tokens": -1, "n": "2"}) == 1024
    assert budget("/v1/completions", {"max_tokens": 0}) == 0
    assert budget("/v1/responses", {"max_output_tokens": 7, "max_tokens": 99}) == 7
    assert budget("/v1/responses", {}) == 1024
    for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/rerank", "/score"):
        assert budget(path, {"max_tokens": 10}) == 0  # nothing generated


# --- concurrency caps ---


async def test_a_key_over_its_concurrency_cap_is_429_with_retry_after(stack: Stack) -> None:
    book, _, auth = await gate(stack, max_concurrent=2)
    engine = stack.engines["a"]
    engine.hold = asyncio.Event()
    held = [asyncio.create_task(stack.post("/v1/chat/completions", chat(), auth)) for _ in range(2)]
    await eventually(lambda: len(engine.received) == 2)
    status, headers, body = await stack.post("/v1/chat/completions", chat(), auth)
    assert status == 429
    assert_openai_error(body, "concurrency_limit_exceeded")
    assert body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    assert len(engine.received) == 2
    engine.hold.set()
    assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
    assert (await stack.post("/v1/chat/completions", chat(), auth))[0] == 200
    assert book.holds.in_flight == {}


async def test_a_refused_request_gives_its_slot_back(stack: Stack) -> None:
    book, _, auth = await gate(stack, max_concurrent=1, token_quota=10_000)
    for body, want in ((chat("nope"), 404), (b"{not json", 400), (chat(max_tokens=5), 200)):
        status, _, _ = await stack.post("/v1/chat/completions", body, auth)
        assert status == want
        assert book.holds.in_flight == {} and book.holds.reserved == {}
    assert (await stream(stack, chat(stream=True), auth))[0] == 200
    assert book.holds.in_flight == {} and book.holds.reserved == {}
