"""Fakes for the two-phase prefill -> decode route: a prefill engine and a decode engine that
check vLLM's NIXL request protocol (docs/decisions/0009-pd-route.md) on every request, and a
stack of them behind a real proxy on loopback sockets.

The prefill fake checks its leg's body (``stream: false``, ``max_tokens: 1``, no
``stream_options``/``min_tokens``, the request shape of ``kv_transfer_params``) and the
``X-Request-Id``; it answers one token and ``kv_transfer_params`` naming its blocks (or none,
as ExampleConnector does). The decode fake checks that it got exactly the params the prefill
handed out for that request id, unchanged, and that the prefill came first. Every deviation
is recorded in ``violations`` (and answered 422), so a test asserts there are none.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
from aiohttp import web

from tests.proxy_fakes import DEADLINE_S, FakeEngine, Stack, free_port, serve, sse
from xhpc.models import PdRole, Route
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.settings import ProxyConfig

# Written out here, not imported from xhpc.proxy.pd: the fake checks the protocol on its own.
PREFILL_REQUEST_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
ParamsMode = Literal["nixl", "absent", "null"]


class Ledger:
    """What the prefill fakes handed out, by request id, and every leg in arrival order."""

    def __init__(self) -> None:
        self.issued: dict[str, dict[str, Any] | None] = {}
        self.legs: list[tuple[str, str, str]] = []  # (role, replica, request id)

    def rids(self, role: str) -> list[str]:
        return [rid for r, _, rid in self.legs if r == role]


class FakePrefill:
    """A prefill instance: checks the prefill leg, answers one token and its KV's location.

    ``params``: "nixl" (kv_transfer_params naming blocks, like NixlConnector), "absent" (no
    key, like ExampleConnector) or "null"; ``status``: answer every request with it.
    """

    def __init__(self, name: str, ledger: Ledger, served_model: str) -> None:
        self.name = name
        self.ledger = ledger
        self.served_model = served_model
        self.params: ParamsMode = "nixl"
        self.status = 200
        self.hold: asyncio.Event | None = None  # wait for it before answering
        self.received: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []
        self.authorization: list[str | None] = []
        self.violations: list[str] = []
        self._n = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/embeddings", self.handle)
        return app

    def _check(self, body: dict[str, Any], rid: str | None) -> list[str]:
        bad = []
        if not rid:
            bad.append("no X-Request-Id")
        if body.get("stream") is not False:
            bad.append(f"stream is {body.get('stream')!r}, not false")
        if body.get("max_tokens") != 1:
            bad.append(f"max_tokens is {body.get('max_tokens')!r}, not 1")
        if body.get("max_completion_tokens", 1) != 1:
            bad.append("max_completion_tokens is not 1")
        for key in ("stream_options", "min_tokens"):
            if key in body:
                bad.append(f"{key} was not removed")
        if body.get("kv_transfer_params") != PREFILL_REQUEST_PARAMS:
            bad.append(f"kv_transfer_params is {body.get('kv_transfer_params')!r}")
        if body.get("model") != self.served_model:
            bad.append(f"model is {body.get('model')!r}")
        return bad

    def _params(self) -> dict[str, Any]:
        self._n += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_request_id": f"req-{self.name}-{self._n}",
            "remote_block_ids": [self._n, self._n + 1, [7, 8]],
            "remote_host": "10.0.0.7",
            "remote_port": 5600 + self._n,
            "tp_size": 1,
            "remote_num_tokens": 37,
        }

    async def handle(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        rid = request.headers.get("X-Request-Id")
        self.received.append(body)
        self.request_ids.append(rid)
        self.authorization.append(request.headers.get("Authorization"))
        self.ledger.legs.append(("prefill", self.name, rid or ""))
        if self.hold is not None:
            await self.hold.wait()
        if self.status != 200:
            error = {"message": f"error at {self.name}", "type": "InternalServerError"}
            return web.json_response({"error": error, "object": "error"}, status=self.status)
        bad = self._check(body, rid)
        if bad:
            self.violations += bad
            return web.json_response({"error": {"message": "; ".join(bad)}}, status=422)
        params = self._params() if self.params == "nixl" else None
        assert rid is not None
        self.ledger.issued[rid] = copy.deepcopy(params)
        answer: dict[str, Any] = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
            "choices": [{"index": 0, "text": "X", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 37, "completion_tokens": 1, "total_tokens": 38},
        }
        if self.params != "absent":
            answer["kv_transfer_params"] = params
        return web.json_response(answer)


class FakeDecode(FakeEngine):
    """A decode instance: a ``FakeEngine`` (streams, breaks, holds, dies on demand) that first
    checks it got exactly the params its prefill handed out for this request id."""

    def __init__(self, name: str, ledger: Ledger) -> None:
        super().__init__(name)
        self.ledger = ledger
        self.request_ids: list[str | None] = []
        self.violations: list[str] = []
        # Answer as vLLM does a request it aborted (its KV never came, its engine stopping):
        # a 200 with no token and no finish reason.
        self.aborts = False

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if not self.aborts:
            return await super().chat(request)
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        head = {"id": "chatcmpl-1", "created": 1, "model": body["model"]}
        usage = {"prompt_tokens": 19, "completion_tokens": 0, "total_tokens": 19}
        if not body.get("stream"):
            message = {"role": "assistant", "content": ""}
            choice = {"index": 0, "message": message, "finish_reason": "abort"}
            return web.json_response(
                {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        for event in (
            {**head, "object": "chat.completion.chunk", "choices": [role]},
            {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage},
        ):
            await resp.write(sse(event))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _admit(self, request: web.Request) -> dict[str, Any] | web.Response:
        rid = request.headers.get("X-Request-Id")
        self.request_ids.append(rid)
        self.ledger.legs.append(("decode", self.name, rid or ""))
        body = await super()._admit(request)
        if isinstance(body, web.Response):
            return body
        bad = []
        if not rid or rid not in self.ledger.issued:
            bad.append(f"request id {rid!r} was never prefilled")
        else:
            issued = self.ledger.issued[rid]
            if issued is None and "kv_transfer_params" in body:
                bad.append("kv_transfer_params sent though the prefill gave none")
            if issued is not None and body.get("kv_transfer_params") != issued:
                bad.append(f"kv_transfer_params changed: {body.get('kv_transfer_params')!r}")
        if bad:
            self.violations += bad
            return web.json_response({"error": {"message": "; ".join(bad)}}, status=422)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Streamed completions too (the base fake answers completions only as a body)."""
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": [
                        {"index": 0, "text": f"text from {self.name}", "finish_reason": "length"}
                    ],
                    "usage": {"prompt_tokens": 37, "completion_tokens": 4, "total_tokens": 41},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text, finish in (("te", None), ("xt", "length")):
            choice = {"text": text, "finish_reason": finish}
            chunk = sse({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
            await resp.write(chunk)
            self.sent += chunk
        await resp.write(b"data: [DONE]\n\n")
        self.sent += b"data: [DONE]\n\n"
        await resp.write_eof()
        return resp


class PdStack:
    """A proxy in front of fake prefill and decode instances of PD models (and, through
    ``stack``, any plain fake engine)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.ledger = Ledger()
        self.prefills: dict[str, FakePrefill] = {}
        self.decodes: dict[str, FakeDecode] = {}

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def client(self) -> aiohttp.ClientSession:
        return self.stack.client

    def _route(self, rid: str, model: str, url: str, role: PdRole, secret: str | None) -> None:
        self.stack.routes[rid] = Route(
            model=model,
            replica_id=rid,
            url=url,
            served_model=f"/models/{model}",
            secret=secret,
            role=role,
            unit=f"unit-{rid}",
        )

    async def prefill(self, rid: str, model: str = "pd", secret: str | None = None) -> FakePrefill:
        engine = FakePrefill(rid, self.ledger, f"/models/{model}")
        url = await self.stack.exits.enter_async_context(serve(engine.app()))
        self.prefills[rid] = engine
        self._route(rid, model, url, PdRole.PREFILL, secret)
        return engine

    async def decode(self, rid: str, model: str = "pd", secret: str | None = None) -> FakeDecode:
        engine = FakeDecode(rid, self.ledger)
        url = await self.stack.exits.enter_async_context(serve(engine.app()))
        self.decodes[rid] = engine
        self._route(rid, model, url, PdRole.DECODE, secret)
        return engine

    def dead(self, rid: str, role: PdRole, model: str = "pd") -> None:
        """An instance nothing listens on (connections are refused)."""
        self._route(rid, model, f"http://127.0.0.1:{free_port()}", role, None)

    def publish(self, *replica_ids: str) -> None:
        self.stack.publish(*replica_ids)

    def violations(self) -> list[str]:
        engines: list[FakePrefill | FakeDecode] = [*self.prefills.values(), *self.decodes.values()]
        return [f"{e.name}: {v}" for e in engines for v in e.violations]

    async def post(
        self, body: Any, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        return await self.stack.post(path, body, headers)

    async def stream(
        self, body: Any, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        data = json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.content.read()


@contextlib.asynccontextmanager
async def open_pd_stack(
    config: ProxyConfig | None = None,
    keys: KeyBook | None = None,
    upstream_timeout_s: float = DEADLINE_S,
) -> AsyncIterator[PdStack]:
    async with contextlib.AsyncExitStack() as exits, aiohttp.ClientSession() as client:
        stack = Stack(exits, client)
        await stack.start_proxy(upstream_timeout_s, config=config or ProxyConfig(), keys=keys)
        yield PdStack(stack)
