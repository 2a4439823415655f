"""The gateway's errors and their OpenAI-shaped bodies.

Every error the proxy answers itself has the body::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

    400 invalid_json / missing_model   the request body is not a JSON object naming a model
    400 bad_http_request               the request broke HTTP/1.1 (``xhpc.proxy.process.listener``)
    400 invalid_request_body           its body could not be read (the client left, a bad encoding)
    400 context_length_exceeded        its body is larger than any prompt the model's context
                                       could take (``xhpc.proxy.engines.contexts``)
    404 model_not_found                the model is not deployed
    404 not_found, 405 ...             unknown path or method
    408 request_timeout                its head or body did not arrive in time (then closed)
    413 request_too_large              the body is over its path's limit (``proxy.body_limits``,
                                       ``proxy.max_body_bytes``)
    431 request_header_fields_too_large  a header or the request line is too long, or too many
    503 too_many_connections           the worker serves ``proxy.max_connections`` already
    503 no_ready_replica               no replica is READY, or every one is ejected (Retry-After)
    404 endpoint_not_served            the model's engine does not serve the path (it answered
                                       404 with no OpenAI error of its own)
    502 upstream_unreachable           the engine could not be reached or broke the connection
    502 upstream_bad_answer            the engine's answer broke HTTP/1.1 (framing, limits), or a
                                       prefill engine's answer was not a JSON object
    502 upstream_answer_too_large      the engine's whole answer was over the proxy's limit
    504 upstream_timeout               the engine did not answer in time
    other                              the engine's own status and body, passed through

A stream that breaks after bytes reached the client ends with an error event and no ``[DONE]``
(``[DONE]`` says the answer is whole; a client that ignores the error still sees it is not)::

    data: {"error": {"message": ..., "type": "upstream_error", "param": null, "code": ...}}
"""

from __future__ import annotations

import json

from aiohttp import hdrs, web

from xhpc.errors import NotFoundError, XhpcError, error_body
from xhpc.models import Route
from xhpc.proxy.engines.upstream_api import UpstreamProtocolError

MAX_ECHOED_CHARS = 64  # of a client's string quoted back in an error message


def clipped(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """``text`` as an error message quotes it: at most ``limit`` characters of it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class UnknownModelError(NotFoundError):
    """The requested model is not served by this deployment at all (HTTP 404). The message
    quotes at most the first ``MAX_ECHOED_CHARS`` characters of the name the client sent."""

    code = "model_not_found"

    def __init__(self, model: str, known: tuple[str, ...]) -> None:
        self.model = model
        self.known = known
        hint = f"served models: {', '.join(known)}" if known else "no models are deployed"
        super().__init__(f"model {clipped(model)!r} does not exist", hint=hint)


class NoReadyReplicaError(XhpcError):
    """The model is deployed but no replica of it may take a request now (HTTP 503).

    ``retry_after_s`` is when one may again, if known (a circuit breaker's cool-down).
    """

    code = "no_ready_replica"

    def __init__(
        self,
        model: str,
        *,
        ejected: bool = False,
        retry_after_s: float | None = None,
        role: str | None = None,
    ) -> None:
        self.model = model
        self.ejected = ejected
        self.retry_after_s = retry_after_s
        self.role = role  # a prefill/decode model's missing half
        what = f"{role} instance" if role else "replica"
        if ejected:
            message = f"every {what} of model {model!r} is ejected after repeated failures"
            hint = "the proxy probes them again after a cool-down; retry later"
        else:
            message = f"model {model!r} has no ready {what}"
            hint = "replicas may still be starting; retry later or check `xhpc ps`"
        super().__init__(message, hint=hint)


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-shaped error response."""
    body = error_body(message, type_=type_, code=code)
    return web.json_response(body, status=status, headers=headers)


def sse_error_event(message: str, *, code: str, type_: str = "upstream_error") -> bytes:
    """The error event that ends a broken stream (no ``[DONE]`` follows: the answer is cut)."""
    body = error_body(message, type_=type_, code=code)
    return b"data: " + json.dumps(body).encode() + b"\n\n"


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


def routing_error(err: XhpcError, retry_after_s: int) -> ProxyHTTPError:
    """The HTTP error for a routing failure (unknown model 404, no ready replica 503)."""
    if isinstance(err, UnknownModelError):
        return ProxyHTTPError(404, err.one_line(), type_="invalid_request_error", code=err.code)
    if isinstance(err, NoReadyReplicaError):
        wait = retry_after_s
        if err.retry_after_s is not None:
            wait = max(1, int(err.retry_after_s + 0.999))
        return ProxyHTTPError(
            503,
            err.one_line(),
            type_="service_unavailable",
            code=err.code,
            headers={hdrs.RETRY_AFTER: str(wait)},
        )
    return ProxyHTTPError(500, err.one_line(), type_="server_error", code=err.code)


def bad_request(message: str, code: str) -> ProxyHTTPError:
    return ProxyHTTPError(400, message, type_="invalid_request_error", code=code)


def too_large(limit: int) -> ProxyHTTPError:
    return ProxyHTTPError(
        413,
        f"request body is larger than the proxy's limit of {limit} bytes",
        type_="invalid_request_error",
        code="request_too_large",
    )


def request_timeout(what: str, limit_s: float) -> ProxyHTTPError:
    """The client did not send ``what`` (its request's head or body) within ``limit_s``."""
    return ProxyHTTPError(
        408,
        f"the request's {what} did not arrive within {limit_s:g}s",
        type_="invalid_request_error",
        code="request_timeout",
    )


def upstream_timeout(err: BaseException) -> ProxyHTTPError:
    return ProxyHTTPError(
        504,
        f"the engine did not answer in time ({type(err).__name__})",
        type_="upstream_timeout",
        code="upstream_timeout",
    )


def upstream_bad_answer(what: str) -> ProxyHTTPError:
    return ProxyHTTPError(
        502,
        f"the engine's answer was not usable: {what}",
        type_="upstream_error",
        code="upstream_bad_answer",
    )


def upstream_unreachable(err: BaseException) -> ProxyHTTPError:
    """The 502 for an engine that could not be reached, dropped the connection, or broke
    HTTP/1.1 (``err`` is one of ``xhpc.proxy.engines.upstream_api``'s errors)."""
    if isinstance(err, UpstreamProtocolError):
        return ProxyHTTPError(502, str(err), type_="upstream_error", code=err.code)
    return ProxyHTTPError(
        502,
        f"could not reach the engine ({type(err).__name__})",
        type_="upstream_error",
        code="upstream_unreachable",
    )


def engine_lacks(route: Route, method: str, path: str) -> ProxyHTTPError:
    """The model's engine answered 404 for the path itself (no such endpoint there)."""
    engine = route.engine.value if route.engine is not None else "its engine"
    return ProxyHTTPError(
        404,
        f"model {route.model!r} is served by {engine}, which does not serve "
        f"{method} {clipped(path, 256)}",
        type_="invalid_request_error",
        code="endpoint_not_served",
    )


def is_openai_error(body: object) -> bool:
    """Whether an answer's body is an OpenAI-shaped error (``{"error": {...}}``): an engine's
    own 404 for a model or a resource, not its web framework's for a path it lacks."""
    if not isinstance(body, bytes) or b'"error"' not in body:
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
