"""Component tests: streams that survive their engine's death (decision 0012) — a proxy on a
real loopback port in front of vLLM-shaped fake engines whose greedy "model" is a function of
the token sequence, so that a continuation from the right tokens gives the undisturbed text."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tests.proxy_fakes import DEADLINE_S, Stack, assert_openai_error, open_stack, serve
from xhpc.models import Route
from xhpc.proxy.relay.resume import Resume, refusal, wanted
from xhpc.proxy.relay.sse import data_of, split_events
from xhpc.settings import ProxyConfig

SERVED = "/models/m"
BOS = 1


def tokenize(text: str) -> list[int]:
    return [BOS, *(ord(c) for c in text)]


def render_chat(messages: list[dict[str, Any]]) -> list[int]:
    """The fake's chat template: ``role: content`` lines, then ``assistant:``."""
    return tokenize("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


def next_token(seq: list[int]) -> int:
    """The fake model's greedy choice after ``seq``: a letter, depending on all of it."""
    return 97 + (sum(t * (i + 1) for i, t in enumerate(seq)) * 7 + len(seq)) % 26


def greedy(prompt_ids: list[int], n: int) -> list[int]:
    seq = list(prompt_ids)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt_ids) :]


def text_of(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Vllm:
    """A vLLM-shaped engine (chunks as vLLM 0.32 writes them, ``return_token_ids``,
    ``stream_options``, ``POST /tokenize``). ``plan`` is shared by the engines of a test: each
    stream pops its first entry, if any, and breaks after that many token chunks."""

    def __init__(self, name: str, plan: list[int], per_chunk: int = 1) -> None:
        self.name = name
        self.plan = plan
        self.per_chunk = per_chunk  # tokens per chunk (vLLM merges them under load)
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.max_model_len = 60
        self.refuse_token_ids = False  # answer 422 to return_token_ids (transformers serve)
        self.reasoning = False  # chat deltas carry "reasoning" (a reasoning parser)
        self.break_after_finish = False  # die after the finish chunk, before usage and [DONE]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.received.append((request.path, body))
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = tokenize(body.get("prompt", ""))
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        )

    def _refuse(self, body: dict[str, Any]) -> web.Response | None:
        if self.refuse_token_ids and "return_token_ids" in body:
            detail = "Unexpected fields in the request: {'return_token_ids'}"
            return web.json_response({"detail": detail}, status=422)
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        refused = self._refuse(body)
        if refused is not None:
            return refused
        prompt = body["prompt"]
        prompt_ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = body.get("max_tokens") or 16
        return await self._stream(request, body, prompt_ids, max_tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        refused = self._refuse(body)
        if refused is not None:
            return refused
        prompt_ids = render_chat(body["messages"])
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = budget or self.max_model_len - len(prompt_ids)
        return await self._stream(request, body, prompt_ids, max_tokens, chat=True)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt_ids: list[int],
        max_tokens: int,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        ids = body.get("return_token_ids") is True
        options = body.get("stream_options") or {}
        usage, continuous = options.get("include_usage"), options.get("continuous_usage_stats")
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{self.name}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1000 + ord(self.name[0]),
            "model": body["model"],
        }
        breaks = self.plan.pop(0) if self.plan else None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            role |= {"logprobs": None, "finish_reason": None}
            first = {**head, "choices": [role], "prompt_token_ids": prompt_ids if ids else None}
            await resp.write(sse({**first, "prompt_text": None}))
        tokens = greedy(prompt_ids, max_tokens)
        sent = 0
        for n, at in enumerate(range(0, len(tokens), self.per_chunk)):
            if n == breaks:
                await self._die(request)
                return resp
            piece = tokens[at : at + self.per_chunk]
            sent += len(piece)
            finish = "length" if sent == len(tokens) else None
            choice: dict[str, Any] = {"index": 0}
            if chat:
                delta: dict[str, Any] = {"content": text_of(piece)}
                if self.reasoning:
                    delta = {"reasoning": text_of(piece)}
                choice |= {"delta": delta, "logprobs": None, "finish_reason": finish}
                if finish:
                    choice["stop_reason"] = None
            else:
                choice |= {"text": text_of(piece), "logprobs": None, "finish_reason": finish}
                choice |= {"stop_reason": None, "prompt_token_ids": None}
                if ids and n == 0:
                    choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = piece if ids else None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = numbers(len(prompt_ids), sent)
            await resp.write(sse(chunk))
        if self.break_after_finish:
            await self._die(request)
            return resp
        if usage:
            await resp.write(sse({**head, "choices": [], "usage": numbers(len(prompt_ids), sent)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _die(request: web.Request) -> None:
        await asyncio.sleep(0.01)  # let the bytes leave before the connection dies
        assert request.transport is not None
        request.transport.abort()


def numbers(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


class Cast:
    """A proxy and vLLM-shaped engines; the first engine is the one a request goes to."""

    def __init__(self, stack: Stack, plan: list[int]) -> None:
        self.stack = stack
        self.plan = plan
        self.engines: dict[str, Vllm] = {}

    async def engine(self, name: str, per_chunk: int = 1) -> Vllm:
        engine = Vllm(name, self.plan, per_chunk)
        url = await self.stack.exits.enter_async_context(serve(engine.app()))
        self.stack.routes[name] = Route(model="m", replica_id=name, url=url, served_model=SERVED)
        self.engines[name] = engine
        return engine

    def publish(self, first: str, *others: str) -> None:
        self.stack.publish(first, *others)
        for other in others:  # busy: the request goes to ``first``
            self.stack.router.acquire(self.stack.routes[other])

    async def stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> bytes:
        data = json.dumps({"model": "m", "stream": True, **body}).encode()
        async with asyncio.timeout(DEADLINE_S):
            url = self.stack.url + path
            async with self.stack.client.post(url, data=data, headers=headers) as resp:
                assert resp.status == 200
                return await resp.content.read()


@contextlib.asynccontextmanager
async def cast(plan: list[int] | None = None, **config: Any) -> AsyncIterator[Cast]:
    settings = ProxyConfig(**{"continue_streams": True, **config})
    async with open_stack(settings) as stack:
        yield Cast(stack, [3] if plan is None else plan)


def events(raw: bytes) -> list[Any]:
    """Every event's data, decoded ("[DONE]" as the string)."""
    out: list[Any] = []
    for event in split_events(raw):
        payload = data_of(event)
        assert payload is not None, event
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def assert_whole(raw: bytes, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    """One well-formed stream: every event parses, one id/object/created/model, at most one
    role chunk (chat), exactly one finish_reason, no error, then [DONE]. Its text and chunks."""
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = events(raw)
    assert chunks[-1] == "[DONE]" and "[DONE]" not in chunks[:-1]
    chunks = chunks[:-1]
    assert all("error" not in c for c in chunks)
    heads = {(c["id"], c["object"], c["created"], c["model"]) for c in chunks}
    assert len(heads) == 1, heads
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    if chat:
        roles = [ch for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
        assert len(roles) == 1 and chunks[0]["choices"] == roles
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    else:
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    return text, chunks


def assert_broken(raw: bytes) -> None:
    """The stream ends with the error event of today, and no [DONE]."""
    found = events(raw)
    assert "[DONE]" not in found
    assert_openai_error(found[-1], "upstream_stream_broken")


CHAT_MESSAGES = [{"role": "user", "content": "hi there"}]


# --- completions ---


@pytest.mark.parametrize("per_chunk", [1, 2])
async def test_a_completion_broken_after_3_chunks_goes_on_elsewhere_as_one_stream(
    per_chunk: int,
) -> None:
    async with cast() as c:
        a, b = await c.engine("a", per_chunk), await c.engine("b", per_chunk)
        c.publish("a", "b")
        request = {
            "prompt": "Hello",
            "max_tokens": 12,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        raw = await c.stream("/v1/completions", request)
        text, chunks = assert_whole(raw, chat=False)
        prompt_ids = tokenize("Hello")
        assert text == text_of(greedy(prompt_ids, 12))  # the undisturbed answer
        assert chunks[0]["id"] == "cmpl-a" and chunks[0]["created"] == 1000 + ord("a")
        assert chunks[-1]["usage"] == numbers(len(prompt_ids), 12)  # the prompt counted once
        assert all(ch["token_ids"] is None for c in chunks for ch in c["choices"])
        assert all(ch["prompt_token_ids"] is None for c in chunks for ch in c["choices"])
        assert a.received == [
            ("/v1/completions", {**request, "model": SERVED, "stream": True,
                                 "return_token_ids": True}),
        ]  # fmt: skip
        sent = 3 * per_chunk
        assert b.received == [
            (
                "/v1/completions",
                {
                    **request,
                    "model": SERVED,
                    "stream": True,
                    "prompt": prompt_ids + greedy(prompt_ids, sent),
                    "max_tokens": 12 - sent,
                    "return_token_ids": True,
                },
            )
        ]
        metrics = await c.stack.metrics()
        assert 'xhpc_proxy_retries_total{model="m",reason="stream_continued"} 1' in metrics


async def test_the_first_chunks_reach_the_client_as_vllm_writes_them_without_token_ids() -> None:
    async with cast(plan=[]) as c:
        await c.engine("a")
        c.publish("a")
        request = {"prompt": "Hello", "max_tokens": 5}
        with_ids = await c.stream("/v1/completions", request)
        plain = await c.stream("/v1/completions", request, {"X-Xhpc-Continue": "0"})
        assert with_ids == plain  # byte for byte
        body = c.engines["a"].received[1][1]
        assert "return_token_ids" not in body


async def test_a_completion_without_max_tokens_has_16_in_all() -> None:
    async with cast() as c:
        await c.engine("a")
        await c.engine("b")
        c.publish("a", "b")
        raw = await c.stream("/v1/completions", {"prompt": [BOS, 70, 71]})
        text, _ = assert_whole(raw, chat=False)
        assert text == text_of(greedy([BOS, 70, 71], 16))
        assert c.engines["b"].received[0][1]["max_tokens"] == 13


async def test_continuous_usage_and_client_token_ids_are_kept_consistent() -> None:
    async with cast() as c:
        await c.engine("a")
        await c.engine("b")
        c.publish("a", "b")
        request = {
            "prompt": "Hey",
            "max_tokens": 8,
            "min_tokens": 5,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        raw = await c.stream("/v1/completions", request)
        text, chunks = assert_whole(raw, chat=False)
        prompt_ids = tokenize("Hey")
        assert text == text_of(greedy(prompt_ids, 8))
        ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        assert ids == greedy(prompt_ids, 8)  # asked for by the client: kept
        assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
        later = [ch["prompt_token_ids"] for c in chunks[1:] for ch in c["choices"]]
        assert later == [None] * len(later)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == [*range(1, 9), 8]
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(prompt_ids)}
        assert c.engines["b"].received[0][1]["min_tokens"] == 2


# --- chat ---


async def test_a_chat_goes_on_through_completions_with_the_context_it_has_left() -> None:
    async with cast() as c:
        a, b = await c.engine("a"), await c.engine("b")
        c.publish("a", "b")
        request = {
            "messages": CHAT_MESSAGES,
            "temperature": 0,
            "chat_template_kwargs": {"x": 1},
            "stream_options": {"include_usage": True},
        }
        raw = await c.stream("/v1/chat/completions", request)
        text, chunks = assert_whole(raw, chat=True)
        prompt_ids = render_chat(CHAT_MESSAGES)
        left = a.max_model_len - len(prompt_ids)
        assert text == text_of(greedy(prompt_ids, left))
        assert chunks[-1]["usage"] == numbers(len(prompt_ids), left)
        assert "prompt_token_ids" in chunks[0] and chunks[0]["prompt_token_ids"] is None
        tokenized, continued = b.received
        assert tokenized == ("/tokenize", {"model": SERVED, "prompt": ""})
        assert continued == (
            "/v1/completions",
            {
                "model": SERVED,
                "stream": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
                "prompt": prompt_ids + greedy(prompt_ids, 3),
                "max_tokens": b.max_model_len,  # vLLM caps it at what the context has left
                "return_token_ids": True,
            },
        )
        # the continuation's chunks look like the first engine's
        shapes = {tuple(ch) for c in chunks[1:-2] for ch in c["choices"]}
        assert shapes == {("index", "delta", "logprobs", "finish_reason", "token_ids")}
        assert list(chunks[-2]["choices"][0]) == [
            "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"
        ]  # fmt: skip


async def test_a_chat_budget_is_max_completion_tokens_less_what_was_sent() -> None:
    async with cast() as c:
        await c.engine("a")
        await c.engine("b")
        c.publish("a", "b")
        request = {"messages": CHAT_MESSAGES, "max_completion_tokens": 9, "max_tokens": 40}
        raw = await c.stream("/v1/chat/completions", request)
        text, _ = assert_whole(raw, chat=True)
        assert text == text_of(greedy(render_chat(CHAT_MESSAGES), 9))
        body = c.engines["b"].received[0][1]
        assert body["max_tokens"] == 6 and "max_completion_tokens" not in body
        assert "messages" not in body


async def test_a_stream_whole_when_its_engine_died_gets_its_usage_and_done_only() -> None:
    async with cast(plan=[]) as c:
        a, b = await c.engine("a"), await c.engine("b")
        a.break_after_finish = True
        c.publish("a", "b")
        request = {"messages": CHAT_MESSAGES, "max_tokens": 4}
        raw = await c.stream(
            "/v1/chat/completions", {**request, "stream_options": {"include_usage": True}}
        )
        text, chunks = assert_whole(raw, chat=True)
        assert text == text_of(greedy(render_chat(CHAT_MESSAGES), 4))
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == numbers(len(render_chat(CHAT_MESSAGES)), 4)
        assert b.received == []


# --- what is not continued ---


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"n": 2}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"logprobs": 0}),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("/v1/chat/completions", {"tool_choice": "required"}),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}),
        ("/v1/chat/completions", {"guided_regex": "a+"}),
        ("/v1/chat/completions", {"guided_choice": ["a", "b"]}),
        ("/v1/chat/completions", {"guided_grammar": "root ::= 'a'"}),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}),
        ("/v1/completions", {"best_of": 2}),
        ("/v1/completions", {"echo": True}),
        ("/v1/chat/completions", {"stop": ["\n"]}),
        ("/v1/chat/completions", {"frequency_penalty": 0.5}),
    ],
)
async def test_requests_whose_output_cannot_be_continued_end_with_the_error_event(
    path: str, extra: dict[str, Any]
) -> None:
    async with cast() as c:
        a, b = await c.engine("a"), await c.engine("b")
        c.publish("a", "b")
        base = {"messages": CHAT_MESSAGES} if "chat" in path else {"prompt": "Hello"}
        raw = await c.stream(path, {**base, "max_tokens": 10, **extra})
        assert_broken(raw)
        assert "return_token_ids" not in a.received[0][1]
        assert b.received == []


async def test_off_by_default_and_per_request_by_header() -> None:
    async with cast(plan=[3, 3], continue_streams=False) as c:
        a, b = await c.engine("a"), await c.engine("b")
        c.publish("a", "b")
        request = {"prompt": "Hello", "max_tokens": 10}
        assert_broken(await c.stream("/v1/completions", request))
        assert b.received == [] and "return_token_ids" not in a.received[0][1]
        raw = await c.stream("/v1/completions", request, {"X-Xhpc-Continue": "1"})
        text, _ = assert_whole(raw, chat=False)
        assert text == text_of(greedy(tokenize("Hello"), 10))
    async with cast(plan=[3]) as c:
        await c.engine("a")
        await c.engine("b")
        c.publish("a", "b")
        raw = await c.stream("/v1/completions", request, {"X-Xhpc-Continue": "0"})
        assert_broken(raw)


async def test_no_other_replica_or_a_spent_budget_ends_with_the_error_event() -> None:
    async with cast() as c:
        await c.engine("a")
        c.publish("a")
        assert_broken(await c.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 10}))
    async with cast(plan=[3, 2]) as c:  # the continuation breaks too
        await c.engine("a")
        await c.engine("b")
        await c.engine("c")
        c.publish("a", "b", "c")
        assert_broken(await c.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 10}))
        assert [len(e.received) for e in c.engines.values()].count(0) == 1


async def test_a_second_continuation_when_allowed_completes_the_stream() -> None:
    async with cast(plan=[3, 2], max_continuations=2) as c:
        await c.engine("a")
        await c.engine("b")
        await c.engine("c")
        c.publish("a", "b", "c")
        raw = await c.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 10})
        text, _ = assert_whole(raw, chat=False)
        assert text == text_of(greedy(tokenize("Hello"), 10))
        bodies = [b for e in c.engines.values() for _, b in e.received]
        assert sorted(b["max_tokens"] for b in bodies) == [5, 7, 10]


async def test_an_engine_that_refuses_token_ids_gets_the_plain_request_and_no_continuation() -> (
    None
):
    async with cast() as c:
        a, b = await c.engine("a"), await c.engine("b")
        a.refuse_token_ids = True
        c.publish("a", "b")
        raw = await c.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 10})
        assert_broken(raw)
        assert [("return_token_ids" in body) for _, body in a.received] == [True, False]
        assert b.received == []
        # once known, the replica gets the plain request at once
        raw = await c.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 10})
        assert_whole(raw, chat=False)
        assert "return_token_ids" not in a.received[-1][1]


async def test_a_chat_with_reasoning_deltas_is_not_continued() -> None:
    async with cast() as c:
        a, b = await c.engine("a"), await c.engine("b")
        a.reasoning = True
        c.publish("a", "b")
        assert_broken(await c.stream("/v1/chat/completions", {"messages": CHAT_MESSAGES}))
        assert b.received == []


# --- units ---


def test_refusal_names_what_makes_output_depend_on_more_than_the_tokens() -> None:
    plain = {"model": "m", "prompt": "x", "stream": True}
    assert refusal(plain, chat=False) is None
    assert refusal({**plain, "prompt": ["x"]}, chat=False) is None
    assert refusal({**plain, "prompt": [[1, 2]]}, chat=False) is None
    assert refusal({**plain, "prompt": ["x", "y"]}, chat=False) == "prompt"
    assert refusal({**plain, "n": 1, "logprobs": None, "stop": []}, chat=False) is None
    assert refusal({**plain, "stop": "\n"}, chat=False) == "stop"
    assert refusal({**plain, "response_format": {"type": "text"}}, chat=False) is None
    assert refusal({**plain, "tool_choice": "none"}, chat=True) is None
    assert refusal({**plain, "presence_penalty": 0}, chat=False) is None
    assert refusal({**plain, "max_tokens": "7"}, chat=False) == "max_tokens"
    assert refusal({"model": "m", "messages": [], "logprobs": False}, chat=True) is None


def test_the_header_overrides_the_config_either_way() -> None:
    assert wanted(False, None) is False and wanted(True, None) is True
    assert wanted(False, "1") is True and wanted(True, "0") is False
    assert wanted(True, "maybe") is True and wanted(False, " TRUE ") is True


def test_token_ids_the_proxy_asked_for_are_set_back_to_null() -> None:
    # as vLLM 0.32 wrote them with return_token_ids, and without (captured)
    asked = (
        b'data: {"id":"cmpl-9","object":"text_completion","created":1,"model":"tiny","choices":'
        b'[{"index":0,"text":"oin","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":[1,324,455],"token_ids":[429]}]}\n\n'
    )
    plain = asked.replace(b"[1,324,455]", b"null").replace(b"[429]", b"null")
    resume = Resume({"prompt": "x"}, chat=False)
    assert resume.client_events(asked) == plain
    assert resume.prompt_ids == [1, 324, 455] and resume.ids == [429]
    tricky = asked.replace(b'"oin"', b'"\\"token_ids\\":[5]"')  # in the text: left alone
    assert Resume({"prompt": "x"}, chat=False).client_events(tricky).count(b"[5]") == 1


def test_split_events_keeps_each_blank_line() -> None:
    raw = b"data: 1\n\ndata: 2\r\n\r\n: c\n\ndata: [DONE]\n\n"
    assert split_events(raw) == [
        b"data: 1\n\n",
        b"data: 2\r\n\r\n",
        b": c\n\n",
        b"data: [DONE]\n\n",
    ]
    assert [data_of(e) for e in split_events(raw)] == [b"1", b"2", None, b"[DONE]"]
    assert split_events(b"data: 1\n\ndata: 2") == [b"data: 1\n\n", b"data: 2"]
