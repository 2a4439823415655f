"""Fakes shared by the proxy's component tests: OpenAI-shaped engines on real loopback sockets,
and a proxy in front of them (no Slurm, no broker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import free_port
from xhpc.models import Route, RoutingTable, Waking
from xhpc.proxy import Router, bound_url, make_app
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.settings import ProxyConfig

DEADLINE_S = 5.0
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/m"} 0.42
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="/models/m"} 1234.0
"""


async def eventually(cond: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll ``cond`` until it holds; fail after the deadline."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serve(app: web.Application, unix_path: Path | None = None) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port (or a UNIX socket); yields its URL (or path)."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        if unix_path is not None:
            await web.UnixSite(runner, str(unix_path)).start()
            yield str(unix_path)
        else:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield bound_url(runner)
    finally:
        await runner.cleanup()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk_event(model: str, content: str, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content else {}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage_event(model: str, usage: dict[str, Any] | None = None) -> bytes:
    """The final chunk vLLM sends with ``stream_options.include_usage``."""
    return sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [],
            "usage": usage or USAGE,
        }
    )


class FakeEngine:
    """An OpenAI-shaped engine that records what it receives and is steerable by the test.

    ``script`` replaces the streamed chunks; ``break_after`` aborts the connection after that
    many chunks (0: right after the response headers); ``status`` answers every request with
    that error status. Like vLLM, a stream ends with a usage chunk when the request's
    ``stream_options.include_usage`` asks for it (unless ``script`` is set).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.metrics = VLLM_METRICS  # what GET /metrics answers (vLLM's, in short)
        self.received: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.hold: asyncio.Event | None = None  # wait for it before answering
        self.between_chunks: asyncio.Event | None = None  # wait for it after the first chunk
        self.status = 200
        self.sent = b""
        self.script: list[bytes] | None = None
        self.break_after: int | None = None
        self.dead = False
        self._in_flight: set[asyncio.BaseTransport] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)

    def kill(self) -> None:
        """Crash: reset every connection in flight, and every new one after its request."""
        self.dead = True
        for transport in self._in_flight:
            transport.abort()
        if self.hold is not None:
            self.hold.set()

    async def _admit(self, request: web.Request) -> dict[str, Any] | web.Response:
        body: dict[str, Any] = await request.json()
        self.received.append(body)
        self.authorization.append(request.headers.get("Authorization"))
        transport = request.transport
        assert transport is not None
        if self.dead:
            transport.abort()
            raise asyncio.CancelledError
        if self.hold is not None:
            self._in_flight.add(transport)
            try:
                await self.hold.wait()
            finally:
                self._in_flight.discard(transport)
            if self.dead:
                raise asyncio.CancelledError
        if self.status != 200:
            error = {"message": f"bad request at {self.name}", "type": "BadRequestError"}
            return web.json_response({"error": error, "object": "error"}, status=self.status)
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await self._stream(request, body["model"], options.get("include_usage"))
        message = {"role": "assistant", "content": f"hello from {self.name}"}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        choice = {"index": 0, "text": f"text from {self.name}", "finish_reason": "stop"}
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [choice],
            }
        )

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request)
        if isinstance(body, web.Response):
            return body
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.25, -0.5, float(len(text))]}
            for i, text in enumerate(inputs)
        ]
        usage = {"prompt_tokens": 4 * len(inputs), "total_tokens": 4 * len(inputs)}
        return web.json_response(
            {"object": "list", "data": data, "model": body["model"], "usage": usage}
        )

    @staticmethod
    def stream_chunks(model: str) -> list[bytes]:
        return [
            sse(chunk_event(model, "Hel")),
            sse(chunk_event(model, "lo ✓")),
            sse(chunk_event(model, "", finish="stop")),
            b"data: [DONE]\n\n",
        ]

    async def _stream(
        self, request: web.Request, model: str, usage: bool = False
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        chunks = self.script if self.script is not None else self.stream_chunks(model)
        if usage and self.script is None:
            chunks = [*chunks[:-1], usage_event(model), chunks[-1]]
        for i, chunk in enumerate(chunks):
            if i == self.break_after:
                break
            await resp.write(chunk)
            self.sent += chunk
            if i == 0 and self.between_chunks is not None:
                await self.between_chunks.wait()
        if self.break_after is not None:
            await asyncio.sleep(0.01)  # let the bytes leave before the connection dies
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp


class ScriptedEngine(asyncio.Protocol):
    """An engine on raw asyncio that answers each request with the bytes ``answer(request)``
    lists, written one piece at a time; ``<close>`` closes the connection there, ``<sleep S>``
    waits S seconds (for answers no framework would write: cut bodies, broken framing)."""

    answer: Callable[[bytes], list[bytes]]
    requests: list[bytes]
    connections: list[ScriptedEngine]
    url: str  # its chat completions URL
    base: str  # http://127.0.0.1:PORT

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = b""
        self.connections.append(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            request, self.buf = head + b"\r\n\r\n" + rest[:length], rest[length:]
            self.requests.append(request)
            asyncio.get_running_loop().create_task(self._answer(request))

    async def _answer(self, request: bytes) -> None:
        for piece in self.answer(request):
            if piece == b"<close>":
                self.transport.close()
                return
            if piece.startswith(b"<sleep "):
                await asyncio.sleep(float(piece[7:-1]))
                continue
            self.transport.write(piece)
            await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def scripted_engine(
    answer: Callable[[bytes], list[bytes]],
) -> AsyncIterator[type[ScriptedEngine]]:
    cls = type("Scripted", (ScriptedEngine,), {"answer": staticmethod(answer)})
    cls.requests = []
    cls.connections = []
    server = await asyncio.get_running_loop().create_server(cls, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cls.base = f"http://127.0.0.1:{port}"
    cls.url = cls.base + "/v1/chat/completions"
    try:
        yield cls
    finally:
        server.close()
        for conn in cls.connections:
            conn.transport.close()


class Stack:
    """A proxy on a free port in front of any number of fake engines."""

    def __init__(self, exits: contextlib.AsyncExitStack, client: aiohttp.ClientSession) -> None:
        self.exits = exits
        self.client = client
        self.router = Router()
        self.url = ""
        self.engines: dict[str, FakeEngine] = {}
        self.routes: dict[str, Route] = {}

    async def start_proxy(
        self,
        upstream_timeout_s: float = DEADLINE_S,
        config: ProxyConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        keys: KeyBook | None = None,
    ) -> str:
        """Serve a proxy; with ``config``, in front of a new router made from it (and
        ``clock``, which its circuit breakers read); with ``keys``, callers need API keys."""
        if config is not None:
            self.router = Router(self.router.table, config=config, clock=clock)
        app = make_app(self.router, upstream_timeout_s=upstream_timeout_s, keys=keys)
        self.url = await self.exits.enter_async_context(serve(app))
        return self.url

    async def engine(self, replica_id: str, model: str = "m") -> FakeEngine:
        engine = FakeEngine(replica_id)
        url = await self.exits.enter_async_context(serve(engine.app()))
        self.engines[replica_id] = engine
        self.routes[replica_id] = Route(
            model=model, replica_id=replica_id, url=url, served_model=f"/models/{model}"
        )
        return engine

    def dead(self, replica_id: str, model: str = "m") -> None:
        """A route to a port nothing listens on (connections are refused)."""
        self.routes[replica_id] = Route(
            model=model,
            replica_id=replica_id,
            url=f"http://127.0.0.1:{free_port()}",
            served_model=f"/models/{model}",
        )

    def publish(
        self,
        *replica_ids: str,
        models: tuple[str, ...] | None = None,
        waking: dict[str, Waking] | None = None,
    ) -> None:
        routes = tuple(self.routes[r] for r in replica_ids)
        names = models if models is not None else tuple(sorted({r.model for r in routes}))
        version = self.router.table.version + 1
        table = RoutingTable(version=version, models=names, routes=routes, waking=waking or {})
        self.router.update(table)

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.json()

    async def stream(self, body: Any) -> tuple[int, bytes]:
        """POST a streamed chat request; the status and every byte of the answer."""
        data = json.dumps(body).encode()
        async with asyncio.timeout(DEADLINE_S):
            async with self.client.post(self.url + "/v1/chat/completions", data=data) as resp:
                return resp.status, await resp.content.read()

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return await resp.text()


@contextlib.asynccontextmanager
async def open_stack(config: ProxyConfig | None = None) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as exits, aiohttp.ClientSession() as client:
        s = Stack(exits, client)
        await s.start_proxy(config=config)
        yield s


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_openai_error(body: Any, code: str) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["param"] is None
    assert isinstance(error["message"], str) and error["message"]
