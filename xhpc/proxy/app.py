"""The OpenAI-compatible HTTP gateway (aiohttp).

The hot path reads only the in-memory ``Router``: it never touches SQLite or the broker. Request
and response bodies (prompts, completions) are forwarded, never logged.

Errors are OpenAI-shaped everywhere::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

    400 invalid_json / missing_model   the request body is not a JSON object naming a model
    404 model_not_found                the model is not deployed
    404 not_found, 405 ...             unknown path or method
    503 no_ready_replica               the model is deployed but no replica is READY (Retry-After)
    502 upstream_unreachable           the engine could not be reached or broke the connection
    504 upstream_timeout               the engine did not answer in time
    other                              the engine's own status and body, passed through
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from xhpc.errors import XhpcError
from xhpc.proxy.routing import NoReadyReplicaError, Router, UnknownModelError

logger = logging.getLogger(__name__)

ClientSessionFactory = Callable[[], aiohttp.ClientSession]
"""The transport seam: builds the one upstream session the app uses (tests inject their own)."""

ROUTER_KEY = web.AppKey("xhpc_router", Router)
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions")
RETRY_AFTER_S = 5
CONNECT_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyHTTPError(Exception):
    """An error the gateway answers itself, as an OpenAI-shaped JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str,
        code: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def response(self) -> web.Response:
        return error_response(
            self.status, self.message, type_=self.type, code=self.code, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-shaped error response."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def default_session_factory() -> aiohttp.ClientSession:
    """One pooled session for all engines: no connection cap, no proxy from the environment."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
    )


def _routing_error(err: XhpcError) -> ProxyHTTPError:
    if isinstance(err, UnknownModelError):
        return ProxyHTTPError(404, err.one_line(), type_="invalid_request_error", code=err.code)
    if isinstance(err, NoReadyReplicaError):
        return ProxyHTTPError(
            503,
            err.one_line(),
            type_="service_unavailable",
            code=err.code,
            headers={hdrs.RETRY_AFTER: str(RETRY_AFTER_S)},
        )
    return ProxyHTTPError(500, err.one_line(), type_="server_error", code=err.code)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyHTTPError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {str(hdrs.ALLOW): exc.headers[hdrs.ALLOW]} if hdrs.ALLOW in exc.headers else None
        code = "not_found" if exc.status == 404 else exc.reason.lower().replace(" ", "_")
        message = f"{exc.reason}: {request.method} {request.path}"
        return error_response(
            exc.status, message, type_="invalid_request_error", code=code, headers=headers
        )
    except Exception:
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return error_response(
            500, "internal proxy error", type_="server_error", code="internal_error"
        )


def _parse_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """The request's JSON object and its ``model``; 400 when either is missing or malformed."""
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise ProxyHTTPError(
            400,
            f"request body is not valid JSON: {err}",
            type_="invalid_request_error",
            code="invalid_json",
        ) from err
    if not isinstance(body, dict):
        raise ProxyHTTPError(
            400,
            "request body must be a JSON object",
            type_="invalid_request_error",
            code="invalid_json",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyHTTPError(
            400,
            "you must provide a model parameter (a non-empty string)",
            type_="invalid_request_error",
            code="missing_model",
        )
    return body, model


class _Gateway:
    """The request handlers and the one upstream session they share."""

    def __init__(
        self, router: Router, upstream_timeout_s: float, session_factory: ClientSessionFactory
    ) -> None:
        self.router = router
        self.session_factory = session_factory
        self.created = int(time.time())
        connect_s = min(CONNECT_TIMEOUT_S, upstream_timeout_s)
        self.timeout = aiohttp.ClientTimeout(total=upstream_timeout_s, connect=connect_s)
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_s, sock_read=upstream_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        self._session = self.session_factory()
        try:
            yield
        finally:
            session, self._session = self._session, None
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's upstream session is not open (app not started)")
        return self._session

    def _model_entry(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "xhpc"}

    async def list_models(self, request: web.Request) -> web.Response:
        data = [self._model_entry(m) for m in self.router.table.models]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in self.router.table.models:
            raise _routing_error(UnknownModelError(model, self.router.table.models))
        return web.json_response(self._model_entry(model))

    async def health(self, request: web.Request) -> web.Response:
        table = self.router.table
        return web.json_response(
            {
                "status": "ok",
                "version": table.version,
                "models": len(table.models),
                "routes": len(table.routes),
            }
        )

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body, model = _parse_body(await request.read())
        stream = body.get("stream") is True
        try:
            route = self.router.pick(model)
        except (UnknownModelError, NoReadyReplicaError) as err:
            raise _routing_error(err) from err
        self.router.acquire(route)
        try:
            logger.debug("routing %s %s to replica %s", request.path, model, route.replica_id)
            body["model"] = route.served_model
            url = route.url.rstrip("/") + request.path
            return await self._upstream(request, url, json.dumps(body).encode(), stream)
        finally:
            self.router.release(route)

    async def _upstream(
        self, request: web.Request, url: str, payload: bytes, stream: bool
    ) -> web.StreamResponse:
        try:
            async with self.session.post(
                url,
                data=payload,
                headers={hdrs.CONTENT_TYPE: "application/json"},
                timeout=self.stream_timeout if stream else self.timeout,
            ) as upstream:
                if stream and upstream.status == 200:
                    return await _relay_stream(request, upstream)
                return await _relay_body(upstream)
        except TimeoutError as err:
            logger.warning("upstream %s timed out", url)
            raise ProxyHTTPError(
                504,
                f"the engine did not answer in time ({type(err).__name__})",
                type_="upstream_timeout",
                code="upstream_timeout",
            ) from err
        except aiohttp.ClientError as err:
            logger.warning("upstream %s unreachable: %s", url, type(err).__name__)
            raise ProxyHTTPError(
                502,
                f"could not reach the engine: {err}",
                type_="upstream_error",
                code="upstream_unreachable",
            ) from err


async def _relay_body(upstream: aiohttp.ClientResponse) -> web.Response:
    """The engine's status, body and content type, as they are."""
    data = await upstream.read()
    headers = {hdrs.CONTENT_TYPE: upstream.headers.get(hdrs.CONTENT_TYPE, "application/json")}
    if hdrs.RETRY_AFTER in upstream.headers:
        headers[hdrs.RETRY_AFTER] = upstream.headers[hdrs.RETRY_AFTER]
    return web.Response(status=upstream.status, body=data, headers=headers)


async def _relay_stream(
    request: web.Request, upstream: aiohttp.ClientResponse
) -> web.StreamResponse:
    """Forward the engine's event stream chunk by chunk, byte-exact, as the chunks arrive."""
    resp = web.StreamResponse(
        status=upstream.status,
        headers={
            hdrs.CONTENT_TYPE: upstream.headers.get(hdrs.CONTENT_TYPE, "text/event-stream"),
            hdrs.CACHE_CONTROL: "no-cache",
        },
    )
    await resp.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            try:
                await resp.write(chunk)
            except ConnectionResetError:
                logger.debug("client went away mid-stream; closing the upstream stream")
                upstream.close()
                return resp
    except (aiohttp.ClientError, TimeoutError) as err:
        logger.warning("upstream stream broke: %s", type(err).__name__)
        event = {
            "error": {
                "message": f"the engine stream broke: {type(err).__name__}",
                "type": "upstream_error",
                "param": None,
                "code": "upstream_stream_broken",
            }
        }
        try:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        except ConnectionResetError:
            return resp
    with contextlib.suppress(ConnectionResetError):  # the client may leave at the very end
        await resp.write_eof()
    return resp


def make_app(
    router: Router,
    *,
    upstream_timeout_s: float,
    client_session_factory: ClientSessionFactory | None = None,
) -> web.Application:
    """The gateway app. It opens one pooled upstream session on startup, closes it on cleanup."""
    gateway = _Gateway(
        router, upstream_timeout_s, client_session_factory or default_session_factory
    )
    app = web.Application(middlewares=[_openai_errors], client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
    app.cleanup_ctx.append(gateway.session_ctx)
    app.router.add_get("/v1/models", gateway.list_models)
    app.router.add_get("/v1/models/{model}", gateway.get_model)
    app.router.add_get("/health", gateway.health)
    for path in FORWARDED_PATHS:
        app.router.add_post(path, gateway.forward)
    return app
