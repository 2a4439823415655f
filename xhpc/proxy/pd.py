"""The two-phase route for prefill/decode (PD) models: prefill on P, then decode on D.

A model whose routes carry a ``role`` is served disaggregated. One client request
becomes two legs with one request id, sent as ``X-Request-Id`` on both (the client's own, if it
sent a plain one; vLLM makes its internal ids unique by itself), following vLLM's NIXL protocol
(docs/decisions/0009-pd-route.md; vLLM's example disaggregation proxy does the same):

1. pick a prefill instance P and a decode instance D, each with its role's policy
   (``proxy.pd_prefill_routing``, affinity by default: a prompt prefix stays on one P, whose
   prefix cache it fills; ``proxy.pd_decode_routing``, least outstanding). D counts the request
   in flight from this pick, so concurrent requests spread over the decode instances while
   they are still prefilling. Neither pick succeeding is a 503 before anything is sent.
2. prefill leg -> P: the client's body with ``stream: false``, ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` if present), no ``stream_options``/``min_tokens``, and the
   request shape of ``kv_transfer_params`` (``PREFILL_KV_REQUEST``). P answers one token and a
   top-level ``kv_transfer_params`` object: where D fetches the KV blocks from.
3. decode leg -> D: the client's original body plus P's ``kv_transfer_params``, unchanged; an
   answer without them (ExampleConnector: the KV went through shared storage) gives a decode
   body without the key. D's answer is relayed exactly as a single-phase answer
   (``Forwarder.attempt``: byte-exact events, ``[DONE]``, usage, the key's usage record).
   A client's own ``kv_transfer_params`` never reaches an engine: it would name another
   request's blocks.

Retries (each spends from the shared retry budget; at most ``max_retries`` per request):

- a prefill leg that fails (connect error, 5xx, an answer that is not a JSON object) is sent
  to another P; a read timeout is a 504, not retried; a 4xx is the client's and is answered as
  it is; a connection that breaks once the leg was sent is a 502, not retried (the request may
  be what broke the engine: ``xhpc.proxy.forward``);
- a decode leg that fails before the client got a byte (connect error, 5xx) is sent to another
  D; as with the prefill leg, a connection that breaks once the leg was sent (a stream that
  died before its first event included) is a 502. If the request never reached D (the
  connection was refused or timed out) P still holds the blocks and the same params go to the
  new D. Otherwise the 5xx may be D failing to reach P (vLLM answers 500 when P is gone), so
  the retry makes a new prefill leg first — on another P if there is one. Without params
  (ExampleConnector) the KV is in shared storage and no new prefill leg is needed;
- a decode answer that is a 200 without a finished answer (vLLM aborts a request whose KV
  never arrives, or whose engine stops, and answers it with no token and no finish reason)
  is a failed decode leg too: a whole answer is retried as above; a stream, whose client
  already has its first chunk, ends with an error event instead of its ``[DONE]``;
- once the client got a byte a broken stream ends with an error event (and no ``[DONE]``).

The route is given the gateway's forwarder as a ``Forwarding``: its router, settings, metrics,
retry budget, ``Upstream`` and single attempts; failures are told by the upstream's errors
(``xhpc.proxy.engines.upstream_api``), as there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from xhpc.endpoints import ENDPOINTS
from xhpc.models import PdRole, Route
from xhpc.proxy.calls import SESSION_HEADER, Call, Retry, relay_body, upstream_headers
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    Upstream,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamReadTimeout,
)
from xhpc.proxy.errors import (
    NoReadyReplicaError,
    ProxyHTTPError,
    UnknownModelError,
    bad_request,
    routing_error,
    upstream_bad_answer,
    upstream_timeout,
    upstream_unreachable,
)
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.relay.answers import unfinished_answer
from xhpc.proxy.relay.resume import Resume
from xhpc.proxy.routes.breaker import RetryBudget
from xhpc.proxy.routes.policies import RequestInfo, affinity_key
from xhpc.proxy.routes.routing import Router
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
PREFILL_KV_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NOT_SENT = frozenset({"connect_error", "connect_timeout"})  # the request never reached D
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

KvParams = dict[str, Any]


def request_id(header: str | None) -> str:
    """The id both legs carry: the client's ``X-Request-Id`` if it is a plain token, else new."""
    if header and _CLIENT_REQUEST_ID.fullmatch(header):
        return header
    return f"xhpc-{uuid.uuid4().hex}"


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: compute the prompt's KV, return one token and where the KV is."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
    return out


def decode_body(body: dict[str, Any], params: KvParams | None) -> dict[str, Any]:
    """The decode leg's body: the client's, plus the prefill's ``kv_transfer_params`` if any."""
    out = dict(body)
    out.pop("kv_transfer_params", None)  # never the client's own
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def kv_params_of(answer: bytes) -> KvParams | None:
    """The ``kv_transfer_params`` of a prefill answer (None: the connector gave none).

    Raises ValueError when the answer is not a JSON object or the params not an object."""
    parsed = json.loads(answer)
    if not isinstance(parsed, dict):
        raise ValueError("the prefill answer is not a JSON object")
    params = parsed.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError("kv_transfer_params is not an object")
    return params


class Forwarding(Protocol):
    """What the PD route uses of the gateway's forwarder (``xhpc.proxy.forward.Forwarder``)."""

    router: Router
    config: ProxyConfig
    metrics: ProxyMetrics
    budget: RetryBudget
    upstream: Upstream
    timeout: Timeouts  # for an answer read whole (the prefill leg)

    async def attempt(
        self,
        request: web.Request,
        route: Route,
        url: str,
        payload: bytes,
        stream: bool,
        call: Call,
        headers: Mapping[str, str] | None = None,
        *,
        resume: Resume | None = None,
        must_finish: bool = False,
    ) -> web.StreamResponse | Retry:
        """One attempt at ``route``, relayed to the client (``Forwarder.attempt``)."""
        ...


class Handoff(NamedTuple):
    """A prefill leg's result for the decode leg."""

    params: KvParams | None


@dataclass(slots=True)
class _Legs:
    """One request's instances and what it has tried."""

    model: str
    info: RequestInfo
    rid: str
    p: Route
    d: Route
    tried_p: list[str] = field(default_factory=list)
    tried_d: list[str] = field(default_factory=list)
    retries: int = 0
    d_unused: bool = True  # no decode leg went to ``d`` yet


class PdRoute:
    """Serves requests for PD models on behalf of the forwarder (its upstream, budget,
    router, metrics and attempts)."""

    def __init__(self, forwarder: Forwarding) -> None:
        self.fwd = forwarder

    def _info(self, request: web.Request, body: dict[str, Any], model: str) -> RequestInfo:
        router = self.fwd.router
        if any(router.policy(model, role).uses_key for role in PdRole):
            key = affinity_key(
                body, request.headers.get(SESSION_HEADER), self.fwd.config.affinity_prefix_chars
            )
            return RequestInfo(model, key)
        return RequestInfo(model)

    def _pick(self, model: str, info: RequestInfo, role: PdRole) -> Route:
        try:
            return self.fwd.router.pick(model, info, role=role)
        except (UnknownModelError, NoReadyReplicaError) as err:
            raise routing_error(err, self.fwd.config.retry_after_s) from err

    async def handle(
        self, request: web.Request, body: dict[str, Any], model: str, call: Call
    ) -> web.StreamResponse:
        if not ENDPOINTS[request.path].two_phase:
            raise bad_request(
                f"model {model!r} is served prefill/decode disaggregated: {request.path} is not "
                "supported for it",
                "unsupported_endpoint",
            )
        router = self.fwd.router
        info = self._info(request, body, model)
        self.fwd.budget.earn()
        p = self._pick(model, info, PdRole.PREFILL)
        try:
            d = self._pick(model, info, PdRole.DECODE)
        except ProxyHTTPError:
            router.abandoned(p)  # a breaker probe slot it may have taken
            raise
        legs = _Legs(model, info, request_id(request.headers.get(REQUEST_ID_HEADER)), p, d)
        router.acquire(d)
        try:
            return await self._run(request, body, legs, call)
        finally:
            if legs.d_unused:
                router.abandoned(legs.d)  # a breaker probe slot it may have taken
            router.release(legs.d)

    async def _run(
        self, request: web.Request, body: dict[str, Any], legs: _Legs, call: Call
    ) -> web.StreamResponse:
        router = self.fwd.router
        stream = body.get("stream") is True
        prefill = prefill_body(body)
        params: KvParams | None = None
        prefilled = False
        while True:
            if not prefilled:
                handoff = await self._prefill(request, prefill, legs, call)
                if isinstance(handoff, Retry):
                    legs.tried_p.append(legs.p.replica_id)
                    p = self._retry(legs, PdRole.PREFILL, handoff, call)
                    if p is None:
                        return handoff.response
                    legs.p = p
                    continue
                if not isinstance(handoff, Handoff):  # the client's own error, e.g. a 400
                    return handoff
                params, prefilled = handoff.params, True
            result = await self._decode(request, decode_body(body, params), stream, legs, call)
            if not isinstance(result, Retry):
                return result
            legs.tried_d.append(legs.d.replica_id)
            d = self._retry(legs, PdRole.DECODE, result, call)
            if d is None:
                return result.response
            router.release(legs.d)
            router.acquire(d)
            legs.d, legs.d_unused = d, True
            if params is not None and result.reason not in NOT_SENT:
                p = self._prefill_again(legs)
                if p is None:
                    return result.response
                legs.p, prefilled = p, False

    def _retry(self, legs: _Legs, role: PdRole, failed: Retry, call: Call) -> Route | None:
        """Another instance of ``role`` for a retry, if the request and the budget allow one."""
        fwd = self.fwd
        if legs.retries >= fwd.config.max_retries:
            return None
        tried = legs.tried_p if role is PdRole.PREFILL else legs.tried_d
        try:
            route = fwd.router.pick(legs.model, legs.info, exclude=tried, role=role)
        except (UnknownModelError, NoReadyReplicaError):
            return None  # no other instance to try
        if not fwd.budget.spend():
            fwd.router.abandoned(route)
            fwd.metrics.retries_denied.inc((call.label,))
            return None
        legs.retries += 1
        fwd.metrics.retries.inc((call.label, f"{role}_{failed.reason}"))
        logger.info("retrying the %s leg on %s after %s", role, route.replica_id, failed.reason)
        return route

    def _prefill_again(self, legs: _Legs) -> Route | None:
        """A prefill instance for a new prefill leg after a decode failure: another one than
        the last if there is one (the failure may have been D reaching it), else the same."""
        router = self.fwd.router
        for exclude in ([*legs.tried_p, legs.p.replica_id], legs.tried_p):
            try:
                return router.pick(legs.model, legs.info, exclude=exclude, role=PdRole.PREFILL)
            except (UnknownModelError, NoReadyReplicaError):
                continue
        return None

    async def _prefill(
        self, request: web.Request, body: dict[str, Any], legs: _Legs, call: Call
    ) -> Handoff | Retry | web.Response:
        """One prefill leg on ``legs.p``: a handoff, a failure to retry, or the engine's answer
        to give the client (a 4xx)."""
        fwd, route, label = self.fwd, legs.p, call.label
        call.replica = route.replica_id
        body["model"] = route.served_model
        start = time.perf_counter()
        try:
            sent = await self._send_prefill(request, route, json.dumps(body), legs.rid)
        except ProxyHTTPError as err:  # a read timeout, a broken connection: not retried
            fwd.metrics.pd_legs.inc((label, "prefill", route.replica_id, str(err.status)))
            fwd.metrics.pd_failures.inc((label, "prefill_failed"))
            raise
        if isinstance(sent, Retry):
            outcome: Handoff | Retry | web.Response = sent
            fwd.metrics.pd_legs.inc((label, "prefill", route.replica_id, sent.reason))
        else:
            outcome = self._prefill_outcome(route, sent)
            fwd.metrics.pd_legs.inc((label, "prefill", route.replica_id, str(sent.status)))
        if isinstance(outcome, Retry):
            fwd.metrics.pd_failures.inc((label, "prefill_failed"))
        elif isinstance(outcome, Handoff):
            fwd.metrics.pd_prefill.observe((label,), time.perf_counter() - start)
            has = "true" if outcome.params is not None else "false"
            fwd.metrics.pd_handoffs.inc((label, has))
        return outcome

    def _prefill_outcome(
        self, route: Route, answer: web.Response
    ) -> Handoff | Retry | web.Response:
        router = self.fwd.router
        if answer.status >= 500:
            router.failed(route)
            return Retry(f"upstream_{answer.status}", answer)
        if answer.status != 200:
            router.succeeded(route)
            return answer
        try:
            data = answer.body if isinstance(answer.body, bytes) else b""
            params = kv_params_of(data)
        except ValueError as err:
            logger.warning("prefill instance %s answered unusably: %s", route.replica_id, err)
            router.failed(route)
            return Retry("bad_answer", upstream_bad_answer(str(err)).response())
        router.succeeded(route)
        return Handoff(params)

    async def _send_prefill(
        self, request: web.Request, route: Route, payload: str, rid: str
    ) -> web.Response | Retry:
        """POST the prefill leg; its answer, or a failure to retry (a read timeout: 504)."""
        fwd, router = self.fwd, self.fwd.router
        url = route.url.rstrip("/") + request.path
        headers = {**upstream_headers(route), REQUEST_ID_HEADER: rid}
        router.acquire(route)
        try:
            async with fwd.upstream.post(
                url, data=payload.encode(), headers=headers, timeout=fwd.timeout
            ) as upstream:
                return await relay_body(upstream, route.replica_id)
        except UpstreamConnectTimeout as err:
            router.failed(route)
            return Retry("connect_timeout", upstream_timeout(err).response())
        except UpstreamReadTimeout as err:
            logger.warning("prefill instance %s did not answer in time", route.replica_id)
            router.failed(route)
            raise upstream_timeout(err) from err
        except UpstreamError as err:  # a connect error, a drop, a broken answer
            logger.warning(
                "prefill instance %s unreachable: %s", route.replica_id, type(err).__name__
            )
            router.failed(route)
            if isinstance(err, UpstreamConnectError):
                return Retry("connect_error", upstream_unreachable(err).response())
            raise upstream_unreachable(err) from err  # P had the leg: never sent elsewhere
        except asyncio.CancelledError:  # the client left: no verdict on the instance
            router.abandoned(route)
            raise
        finally:
            router.release(route)

    async def _decode(
        self, request: web.Request, body: dict[str, Any], stream: bool, legs: _Legs, call: Call
    ) -> web.StreamResponse | Retry:
        """One decode leg on ``legs.d``, relayed to the client; a failure before the client
        got a byte is returned to retry."""
        fwd, route, label = self.fwd, legs.d, call.label
        call.replica = route.replica_id
        body["model"] = route.served_model
        url = route.url.rstrip("/") + request.path
        headers = {**upstream_headers(route), REQUEST_ID_HEADER: legs.rid}
        start = time.perf_counter()
        call.first_byte_at = None
        legs.d_unused = False
        try:
            result = await fwd.attempt(
                request,
                route,
                url,
                json.dumps(body).encode(),
                stream,
                call,
                headers=headers,
                must_finish=True,
            )
        except ProxyHTTPError as err:  # a read timeout, a broken connection: not retried
            fwd.metrics.pd_legs.inc((label, "decode", route.replica_id, str(err.status)))
            fwd.metrics.pd_failures.inc((label, "decode_failed"))
            raise
        if isinstance(result, web.Response) and result.status >= 500 and not result.prepared:
            result = Retry(f"upstream_{result.status}", result)
        elif isinstance(result, web.Response) and result.status == 200 and not result.prepared:
            why = unfinished_answer(result.body) if isinstance(result.body, bytes) else None
            if why is not None:  # aborted (its KV never came, its engine stopped): not an answer
                logger.warning("decode instance %s: %s", route.replica_id, why)
                fwd.router.failed(route)
                result = Retry("unfinished", upstream_bad_answer(why).response())
        outcome = result.reason if isinstance(result, Retry) else str(result.status)
        fwd.metrics.pd_legs.inc((label, "decode", route.replica_id, outcome))
        if isinstance(result, Retry) or call.broken:
            fwd.metrics.pd_failures.inc((label, "decode_failed"))
        if call.first_byte_at is not None:
            fwd.metrics.pd_decode_ttft.observe((label,), call.first_byte_at - start)
        return result
