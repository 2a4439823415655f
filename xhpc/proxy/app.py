"""The OpenAI-compatible HTTP gateway (aiohttp).

The hot path reads only the in-memory ``Router``: it never touches SQLite or the broker. Request
and response bodies (prompts, completions) are forwarded, never logged. Errors are OpenAI-shaped
everywhere (see ``xhpc.proxy.errors``); forwarding, retries and streams are in
``xhpc.proxy.forward``. Engines are reached through one ``Upstream``
(``xhpc.proxy.engines.upstream_api``) per app: the proxy's own client, or what ``upstream_factory``
makes (``aiohttp_upstream``: aiohttp's client).

    GET  /v1/models, /v1/models/{model}     the models in the routing table
    POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /tokenize,
         /detokenize, /v1/rerank, /rerank, /v2/rerank, /v1/score, /score
                                            forwarded to the model's engine
                                            (``xhpc.endpoints``)
    GET  /health                            the table's version and size
    GET  /metrics                           Prometheus text (``xhpc.proxy.metrics``), and
                                            the brokers' (``xhpc.proxy.broker_metrics``); with
                                            API keys, for an admin key only (it names every
                                            model and replica). ``make_metrics_app`` serves it
                                            with no key on ``proxy.metrics_listen``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web

from xhpc.endpoints import ENDPOINTS
from xhpc.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from xhpc.proxy.app_keys import BROKERS_KEY, METRICS_KEY, ROUTER_KEY
from xhpc.proxy.broker_metrics import BrokerSections
from xhpc.proxy.engines.upstream import UpstreamSession
from xhpc.proxy.engines.upstream_api import Upstream
from xhpc.proxy.errors import (
    ProxyHTTPError,
    UnknownModelError,
    clipped,
    error_response,
    routing_error,
)
from xhpc.proxy.forward import Forwarder
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KEYBOOK_KEY, KeyBook, KeyRefused
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

UpstreamFactory = Callable[[], Upstream]
"""Builds the one ``Upstream`` the app reaches engines through, when given (tests inject their
own, or ``aiohttp_upstream``); without one the app uses
``xhpc.proxy.engines.upstream.UpstreamSession``."""

FORWARDED_PATHS = tuple(ENDPOINTS)
# Every path, a newline in it (``%0A``) too: ``.`` would leave it to aiohttp's plain-text 404.
ANY_PATH = r"/{tail:[\s\S]*}"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _openai_error(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The OpenAI-shaped answer to an error a handler raised (called in its ``except``)."""
    if isinstance(exc, ProxyHTTPError | KeyRefused):
        return exc.response()
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        headers = {str(hdrs.ALLOW): exc.headers[hdrs.ALLOW]} if hdrs.ALLOW in exc.headers else None
        code = "not_found" if exc.status == 404 else exc.reason.lower().replace(" ", "_")
        message = f"{exc.reason}: {request.method} {clipped(request.path, 256)}"
        return error_response(
            exc.status, message, type_="invalid_request_error", code=code, headers=headers
        )
    logger.exception("unexpected error handling %s %s", request.method, request.path)
    return error_response(500, "internal proxy error", type_="server_error", code="internal_error")


def _openai_errors(handler: Handler) -> Handler:
    """``handler`` with its errors answered OpenAI-shaped.

    Each handler is wrapped (the forwarding one handles its own errors) instead of an app
    middleware: aiohttp runs every request through two more coroutines when an app has
    middlewares, ~2.5 % of the proxy's CPU per request. Unknown paths and methods reach
    catch-all routes (``_not_found``, ``_method_not_allowed``) for the same reason.
    """

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return _openai_error(request, exc)

    return guarded


async def _not_found(request: web.Request) -> web.StreamResponse:
    return _openai_error(request, web.HTTPNotFound())


def _method_not_allowed(allowed: frozenset[str]) -> Handler:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return _openai_error(request, web.HTTPMethodNotAllowed(request.method, allowed))

    return refuse


class _Gateway:
    """The request handlers and the one upstream they share."""

    def __init__(
        self,
        router: Router,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        upstream_factory: UpstreamFactory | None,
        keys: KeyBook | None = None,
        brokers: BrokerSections | None = None,
    ) -> None:
        self.keys = keys
        self.brokers = brokers
        self.router = router
        self.config = config
        self.metrics = metrics
        self.upstream_factory = upstream_factory
        self.created = int(time.time())
        self._forwarder: Forwarder | None = None

    async def upstream_ctx(self, app: web.Application) -> AsyncIterator[None]:
        factory = self.upstream_factory
        cfg = self.config
        upstream: Upstream = (
            UpstreamSession(idle_s=cfg.upstream_idle_s, max_body_bytes=cfg.max_answer_bytes)
            if factory is None
            else factory()
        )
        self._forwarder = Forwarder(self.router, self.config, self.metrics, upstream, self.keys)
        try:
            yield
        finally:
            self._forwarder = None
            await upstream.close()

    def _model_entry(self, model: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "xhpc",
            "root": model,  # the public name; never an engine's path
        }
        routes = self.router.routes(model)
        parent = self.router.table.parents.get(model)
        if parent is not None:  # a LoRA adapter: the deployment it is served on
            entry["parent"] = parent
        forwarder = self._forwarder
        if forwarder is not None:
            length = forwarder.contexts.model_len(routes)
            if length is not None:
                entry["max_model_len"] = length
        return entry

    def _visible(self, request: web.Request) -> tuple[str, ...]:
        """The models the caller's key may use (all of them when keys are not required)."""
        models = self.router.table.models
        if self.keys is None:
            return models
        grant = self.keys.admit(request.headers.get(hdrs.AUTHORIZATION), charge=False)
        return tuple(self.keys.visible(grant, models))

    async def list_models(self, request: web.Request) -> web.Response:
        data = [self._model_entry(m) for m in self._visible(request)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        visible = self._visible(request)
        if model not in visible:
            raise routing_error(UnknownModelError(model, visible), self.config.retry_after_s)
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

    async def metrics_text(self, request: web.Request) -> web.Response:
        if self.keys is not None:  # it names every model and replica: admins only
            grant = self.keys.identify(request.headers.get(hdrs.AUTHORIZATION))
            if grant is not None and not grant.admin:
                raise KeyRefused(403, "/metrics needs an admin key", "forbidden")
        return await _metrics_response(self.metrics, self.router, self.brokers)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        try:
            if self._forwarder is None:
                raise RuntimeError("the proxy's upstream is not open (app not started)")
            return await self._forwarder.handle(request)
        except Exception as exc:
            return _openai_error(request, exc)


async def _metrics_response(
    metrics: ProxyMetrics, router: Router, brokers: BrokerSections | None
) -> web.Response:
    """The gateway's exposition, then its brokers' (fetched now, by this worker)."""
    text = metrics.render(router)
    if brokers is not None:
        text += await brokers.render()
    return web.Response(body=text.encode(), headers={hdrs.CONTENT_TYPE: METRICS_CONTENT_TYPE})


def make_metrics_app(gateway: web.Application) -> web.Application:
    """``GET /metrics`` of ``gateway`` with no key, for ``proxy.metrics_listen`` (a private
    address for the lab's Prometheus); every other path is a 404."""
    router, metrics, brokers = gateway[ROUTER_KEY], gateway[METRICS_KEY], gateway.get(BROKERS_KEY)

    async def metrics_text(request: web.Request) -> web.Response:
        return await _metrics_response(metrics, router, brokers)

    app = web.Application()
    app.router.add_get("/metrics", _openai_errors(metrics_text))
    app.router.add_route(hdrs.METH_ANY, ANY_PATH, _not_found)
    return app


def make_app(
    router: Router,
    *,
    config: ProxyConfig | None = None,
    upstream_timeout_s: float | None = None,
    upstream_factory: UpstreamFactory | None = None,
    metrics: ProxyMetrics | None = None,
    keys: KeyBook | None = None,
    extra_routes: Callable[[Callable[[str, str, Handler], None]], None] | None = None,
    brokers: BrokerSections | None = None,
) -> web.Application:
    """The gateway app. It opens one pooled ``Upstream`` on startup (``UpstreamSession``, or
    what ``upstream_factory`` makes), closes it on cleanup.

    ``config`` defaults to the router's; ``upstream_timeout_s`` overrides its timeout.
    ``keys``: the API keys callers must present (None: none required).
    ``brokers``: the brokers whose metrics ``/metrics`` adds to the gateway's (None: none).
    ``extra_routes``: called with ``add(method, path, handler)`` to add more endpoints (the
    Batch API's), each answering errors as OpenAI's.
    """
    config = config or router.config
    if upstream_timeout_s is not None:
        config = config.model_copy(update={"upstream_timeout_s": upstream_timeout_s})
    metrics = metrics or ProxyMetrics()
    gateway = _Gateway(router, config, metrics, upstream_factory, keys, brokers)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[ROUTER_KEY] = router
    app[METRICS_KEY] = metrics
    if brokers is not None:
        app[BROKERS_KEY] = brokers
    if keys is not None:
        app[KEYBOOK_KEY] = keys
    app.cleanup_ctx.append(gateway.upstream_ctx)
    get_allowed = frozenset({hdrs.METH_GET, hdrs.METH_HEAD})
    for path, handler in (
        ("/v1/models", gateway.list_models),
        ("/v1/models/{model}", gateway.get_model),
        ("/health", gateway.health),
        ("/metrics", gateway.metrics_text),
    ):
        app.router.add_get(path, _openai_errors(handler))
        app.router.add_route(hdrs.METH_ANY, path, _method_not_allowed(get_allowed))
    for path in FORWARDED_PATHS:
        app.router.add_post(path, gateway.forward)
        app.router.add_route(hdrs.METH_ANY, path, _method_not_allowed(frozenset({"POST"})))
    if extra_routes is not None:

        def add(method: str, path: str, handler: Handler) -> None:
            app.router.add_route(method, path, _openai_errors(handler))

        extra_routes(add)
    app.router.add_route(hdrs.METH_ANY, ANY_PATH, _not_found)  # last: any other path
    return app
