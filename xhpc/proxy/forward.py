"""Forwarding one request to an engine: pick, send, retry before the first byte, relay.

The order of events for ``POST /v1/{chat/completions,completions,embeddings}``:

1. read the body (over its path's limit, ``proxy.body_limits``: 413 before it is read whole;
   too slow: 408, ``xhpc.proxy.process.listener``), parse it (400), pick a replica (404, 503);
   With API keys, the key's limits are held first (``xhpc.proxy.tenants.quota``): a concurrency
   slot, then the request's output budget reserved against the key's token quota (429s);
2. send it with the replica's served model name (a stream also asks for its usage:
   ``xhpc.proxy.relay.body``). Only a request that never reached an engine is retried on another
   replica: a connect error or a connect timeout, or an upstream 503 (the engine's answer
   that it is busy), while nothing has reached the client, at most ``max_retries`` times and
   within the retry budget; otherwise the last failure is answered (502, or the engine's own
   503). Once the request was sent, a connection that breaks before a whole answer (reset,
   closed, a stream that ends before its first event, a body cut short) is a 502 and is never
   sent elsewhere: the request may be what broke the engine, and one poison request must not
   take down every replica in turn; unless the replica's whole job is gone (its agent does not
   answer either, ``xhpc.proxy.engines.liveness``: a lost node), which the request cannot have
   caused, and then it is retried like a connect error (decision 0015). (The proxy's own client,
   ``xhpc.proxy.engines.upstream``, itself sends a request once more on a new connection when a
   reused idle one was closed before any byte of an answer.) The engines are reached through an
   ``Upstream`` (``xhpc.proxy.engines.upstream_api``), and a failure is told by that seam's errors
   alone: a connect error or timeout, a read timeout, a dropped connection, a broken answer;
3. relay the answer: a body as it is; a stream event by event (see ``xhpc.proxy.relay.sse``), with
   the model's public name for the engine's (``xhpc.proxy.relay.answers``) and without the usage
   chunk the client did not ask for. A stream that breaks after the client got bytes ends
   with an error event and no ``[DONE]``, never a hang, and is never retried; a body cut short
   is never a 200 with part of the body. A read timeout is a 504 and is not retried.
4. with ``[proxy] continue_streams`` (or the request's ``X-Xhpc-Continue: 1``), a stream whose
   engine dies after the client got bytes goes on on another replica from the tokens already
   sent, when its output can be continued exactly (``xhpc.proxy.relay.resume``, decision 0012); the
   client sees one stream. Otherwise it ends with the error event as above.

Every outcome feeds the replica's circuit breaker with the engine's faults only: 5xx, connect
errors and timeouts, broken connections, and streams that stall (no byte within the upstream
timeout) count as failures, other answers as successes. What one caller causes decides
nothing: a client leaving (mid-stream, or its handler cancelled), and a body answer that runs
past the upstream timeout (its length is the request's ``max_tokens``, not the engine's fault).

A prefill/decode model (its routes have roles) takes the two-phase route of ``xhpc.proxy.pd``,
which sends its decode leg through ``Forwarder.attempt`` (one attempt at one replica, relayed to
the client) and so relays it exactly like this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import hdrs, web

from xhpc.endpoints import ENDPOINTS
from xhpc.models import Route
from xhpc.proxy.calls import (
    REPLICA_HEADER,
    SESSION_HEADER,
    Call,
    Retry,
    relay_body,
    send_to_client,
    upstream_headers,
)
from xhpc.proxy.engines.contexts import ContextLengths
from xhpc.proxy.engines.liveness import JobLiveness, JobWatch
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    Upstream,
    UpstreamAnswer,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDropped,
    UpstreamError,
    UpstreamReadTimeout,
    UpstreamTimeout,
)
from xhpc.proxy.errors import (
    NoReadyReplicaError,
    ProxyHTTPError,
    UnknownModelError,
    engine_lacks,
    is_openai_error,
    routing_error,
    sse_error_event,
    upstream_timeout,
    upstream_unreachable,
)
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.pd import PdRoute
from xhpc.proxy.relay.answers import FinishWatch, UsageStrip, renamer
from xhpc.proxy.relay.body import RequestBody
from xhpc.proxy.relay.continuation import Continuation
from xhpc.proxy.relay.resume import TOKEN_IDS_FIELD, Resume
from xhpc.proxy.relay.sse import SseRelay, usage_of
from xhpc.proxy.routes.breaker import RetryBudget
from xhpc.proxy.routes.holding import Holds, answer_message, end_early
from xhpc.proxy.routes.policies import RequestInfo, affinity_key
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.proxy.tenants.limits import read_body
from xhpc.proxy.tenants.quota import output_budget
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
NO_TOKEN_IDS = "no_token_ids"  # an engine refused return_token_ids: send it the plain request
# Attempts that never reached an engine (or whose whole job is gone: decision 0015).
UNREACHED = frozenset({"connect_timeout", "connect_error", "job_gone"})


def _stream_response(ctype: str, route: Route) -> web.StreamResponse:
    headers = {
        hdrs.CONTENT_TYPE: ctype,
        hdrs.CACHE_CONTROL: "no-cache",
        REPLICA_HEADER: route.replica_id,
    }
    return web.StreamResponse(status=200, headers=headers)


class Forwarder:
    """Sends requests to engines for the gateway through ``upstream``; holds the retry budget.

    ``handle`` serves a client's request whole (picks, retries, continues a stream);
    ``attempt`` is one try at one replica, relayed to the client, which the PD route builds on.
    """

    def __init__(
        self,
        router: Router,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        upstream: Upstream,
        keys: KeyBook | None = None,
    ) -> None:
        self.keys = keys
        self.router = router
        self.config = config
        self.metrics = metrics
        self.upstream = upstream
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_burst)
        self.no_token_ids: set[str] = set()  # replicas that refuse return_token_ids
        self.contexts = ContextLengths(upstream, upstream_headers, config.bytes_per_context_token)
        self.body_limits = {path: config.body_limit(path) for path in config.body_limits}
        timeout_s = config.upstream_timeout_s
        connect_s = min(CONNECT_TIMEOUT_S, timeout_s)
        self.timeout = Timeouts(total=timeout_s, connect=connect_s)  # an answer read whole
        self.stream_timeout = Timeouts(connect=connect_s, read=timeout_s)  # between events
        self.liveness = JobLiveness()  # a broken connection: the engine's death, or the job's?
        self.continuation = Continuation(
            router, config, metrics, upstream, self.contexts, self.stream_timeout, self.no_token_ids
        )
        self.pd = PdRoute(self)
        self.holds = Holds(router, config)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        call = Call(time.perf_counter())
        keys = self.keys
        if keys is not None:
            call.grant = keys.admit(request.headers.get(hdrs.AUTHORIZATION))
            call.hold = keys.enter(call.grant)  # given back in ``finish`` below
        try:
            try:
                resp = await self._handle(request, call)
            except ProxyHTTPError as err:
                if call.early is None:
                    raise
                resp = await end_early(request, call, err.message, err.code, err.status)
            if call.early is not None and resp is not call.early:  # an answer, not a stream
                resp = await end_early(request, call, answer_message(resp), "upstream_error",
                                       resp.status)  # fmt: skip
            call.status = resp.status
            return resp
        except ProxyHTTPError as err:
            call.status = err.status
            raise
        finally:
            self.metrics.request(
                call.label, call.replica, call.status, time.perf_counter() - call.start
            )
            if keys is not None:
                answered = call.status == 200
                keys.finish(call.grant, call.hold, call.label, call.usage, answered)

    async def _handle(self, request: web.Request, call: Call) -> web.StreamResponse:
        limit = self.body_limits.get(request.path, self.config.max_body_bytes)
        call.endpoint = endpoint = ENDPOINTS[request.path]  # the app routes only these here
        req = RequestBody(await read_body(request, limit))
        model = req.model
        router = self.router
        if self.keys is not None and not self.keys.may_use(call.grant, model):
            # Another user's model is, to this key, a model that does not exist.
            visible = tuple(self.keys.visible(call.grant, router.table.models))
            raise routing_error(UnknownModelError(model, visible), self.config.retry_after_s)
        grant = call.grant
        if self.keys is not None and grant is not None and grant.token_quota is not None:
            budget = output_budget(  # reserved against the quota before anything is sent
                [req.field(name) for name in endpoint.budget_fields],
                req.field("n"),
                self.config.quota_default_max_tokens,
            )
            self.keys.reserve(grant, call.hold, budget)
        options = req.usage_options() if endpoint.usage_chunk else None
        info = None
        if self.holds.waking(model) is not None:  # autoscaled, no replica READY: held
            await self.holds.until_routed(request, call, model, req.stream)
        if router.is_pd(model):
            call.label = model
            call.strip_usage = options is not None
            data = req.data if options is None else {**req.data, "stream_options": options}
            return await self.pd.handle(request, data, model, call)
        if router.knows(model):
            call.label = model
            if router.policy(model).uses_key:
                key = affinity_key(
                    req.data,
                    request.headers.get(SESSION_HEADER),
                    self.config.affinity_prefix_chars,
                )
                info = RequestInfo(model, key)
        stream = req.stream
        resume = self.continuation.tracked(request, req) if stream else None
        self.budget.earn()
        try:
            route = await self._pick_or_hold(request, call, model, info, stream, {})
        except (UnknownModelError, NoReadyReplicaError) as err:
            raise routing_error(err, self.config.retry_after_s) from err
        self.contexts.check(route, len(req.raw))  # the replicas of a model take one length
        tried: list[str] = []
        tried_urls: dict[str, str] = {}  # which route of each replica it tried
        while True:
            call.replica = route.replica_id
            url = route.url.rstrip("/") + request.path
            tracked = resume if route.replica_id not in self.no_token_ids else None
            call.strip_usage = options is not None and tracked is None  # what was asked
            if tracked is not None:
                payload = tracked.first_body(route.served_model)
            else:
                payload = req.upstream(route.served_model, options)
            router.acquire(route)
            try:
                result = await self.attempt(
                    request, route, url, payload, stream, call, resume=tracked
                )
            finally:
                router.release(route)
            if not isinstance(result, Retry):
                if call.held is not None and tracked is not None:
                    tried.append(route.replica_id)
                    return await self.continuation.go_on(
                        request, result, tracked, model, info, tried, call
                    )
                return result
            if result.reason == NO_TOKEN_IDS:  # the same replica, asked the plain way
                if len(self.no_token_ids) >= 4096:
                    self.no_token_ids.clear()
                self.no_token_ids.add(route.replica_id)
                continue
            tried.append(route.replica_id)
            tried_urls[route.replica_id] = route.url
            # An autoscaled model's call that never reached an engine waits for another route.
            held = result.reason in UNREACHED and self.holds.holds_for(model)
            if len(tried) > self.config.max_retries and not held:
                return result.response
            try:
                route = await self._pick_or_hold(
                    request, call, model, info, stream, tried_urls, held
                )
            except (UnknownModelError, NoReadyReplicaError):
                return result.response  # no other replica to try
            # A call that waited for a route of its own is no retry storm's: not charged.
            if call.held_since is None and not self.budget.spend():
                router.abandoned(route)  # a breaker probe slot it may have taken
                self.metrics.retries_denied.inc((call.label,))
                return result.response
            self.metrics.retries.inc((call.label, result.reason))
            logger.info("retrying on %s after %s at %s", route.replica_id, result.reason, tried[-1])

    async def _pick_or_hold(
        self,
        request: web.Request,
        call: Call,
        model: str,
        info: RequestInfo | None,
        stream: bool,
        tried: Mapping[str, str],
        hold: bool = True,
    ) -> Route:
        """The next route for the call, none it tried (``tried``: replica id -> url). An
        autoscaled model's call (with ``hold``) that finds none the router may pick is held
        until one appears: the broker replaces (or re-plans) what was lost
        (``xhpc.proxy.routes.holding``)."""
        router = self.router
        if (
            hold
            and self.holds.holds_for(model)
            and not router.usable(model, router.excluded(tried))
        ):
            await self.holds.until_routed(request, call, model, stream, tried)
        return router.pick(model, info, exclude=router.excluded(tried))

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
        """POST ``payload`` to ``url`` on ``route`` (with ``headers``, else the route's own),
        relay the answer to the client and feed the replica's breaker. With ``must_finish``
        a stream that ends without a finished answer ends with an error event instead of its
        ``[DONE]`` (``xhpc.proxy.relay.answers.FinishWatch``).

        The answer: a body answer (the engine's, or a 504 for a stream that timed out before
        its first event), a stream already relayed (it may have ended with an error event:
        ``call.broken``; or, with ``resume``, been held for a continuation: ``call.held``), or
        a ``Retry`` when the request never reached the engine (a connect error or timeout),
        the engine answered 503, or it refused ``resume``'s token ids. A failure once the
        engine had the request raises the ``ProxyHTTPError`` to answer: a 504 (read timeout)
        or a 502 (a dropped connection, a broken answer). The caller holds the route
        (``Router.acquire``/``release``)."""
        router = self.router
        call.rename = renamer(route.served_model, route.model)
        watch = None
        # A silent job (a lost link): see xhpc.proxy.engines.liveness.
        if route.agent_port is not None:
            after_s = self.config.job_check_after_s
            watch = JobWatch(self.liveness, route, after_s)
        try:
            async with self.upstream.post(
                url,
                data=payload,
                headers=upstream_headers(route) if headers is None else headers,
                timeout=self.stream_timeout if stream else self.timeout,
            ) as upstream:
                if stream and upstream.status == 200:
                    return await self._relay_stream(
                        request, upstream, route, call, resume, watch, must_finish
                    )
                resp = await relay_body(upstream, route.replica_id, call.rename)
                if upstream.status == 404 and not is_openai_error(resp.body):
                    router.succeeded(route)
                    return engine_lacks(route, request.method, request.path).response()
                if resume is not None and _refuses_token_ids(upstream.status, resp.body):
                    router.succeeded(route)
                    return Retry(NO_TOKEN_IDS, resp)
                if upstream.status >= 500:
                    router.failed(route)
                    if upstream.status == 503:
                        return Retry("upstream_503", resp)
                    return resp
                router.succeeded(route)
                if upstream.status == 200 and isinstance(resp.body, bytes):
                    call.usage = usage = usage_of(resp.body)
                    if usage is not None:
                        self.metrics.usage(call.label, *usage)
                return resp
        except UpstreamConnectTimeout as err:  # nothing reached the engine
            logger.warning("connecting to replica %s timed out", route.replica_id)
            router.unreachable(route)
            return Retry("connect_timeout", upstream_timeout(err).response())
        except UpstreamConnectError as err:  # nothing reached the engine
            logger.warning("replica %s unreachable: %s", route.replica_id, type(err).__name__)
            router.unreachable(route)
            return Retry("connect_error", upstream_unreachable(err).response())
        except UpstreamReadTimeout as err:
            logger.warning("replica %s did not answer in time", route.replica_id)
            if stream:
                router.failed(route)  # no byte for upstream_timeout_s: the engine stalled
            else:
                router.abandoned(route)  # a long answer is the request's doing, not a fault
            raise upstream_timeout(err) from err
        except UpstreamError as err:  # dropped, or a broken answer
            logger.warning("replica %s unreachable: %s", route.replica_id, type(err).__name__)
            if isinstance(err, UpstreamDropped) and await self._job_is_gone(route, watch):
                return self._job_gone(route, err)
            router.failed(route)
            # The engine had the request: it may be what broke it. Never sent elsewhere.
            raise upstream_unreachable(err) from err
        except asyncio.CancelledError:  # the client left (or the worker stops): no verdict
            if _watch_cancelled(watch):  # the replica's job fell silent: not the client leaving
                return self._job_gone(route, UpstreamDropped("the replica's job is gone"))
            router.abandoned(route)
            raise
        finally:
            if watch is not None:
                watch.stop()

    async def _job_is_gone(self, route: Route, watch: JobWatch | None) -> bool:
        """Whether the replica's agent is gone (asked after a dropped connection). The watch
        may find it gone at the same moment and cancel this task: that is the same answer."""
        try:
            return await self.liveness.gone(route)
        except asyncio.CancelledError:
            if _watch_cancelled(watch):
                return True
            raise

    async def _broke(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        route: Route,
        call: Call,
        strip: UsageStrip | None,
        why: str,
        continuable: bool,
    ) -> web.StreamResponse:
        """A stream under way broke: it is continued elsewhere (``call.held``, when it can be)
        or ends with an error event and no ``[DONE]``."""
        logger.warning("replica %s stream broke: %s", route.replica_id, why)
        self.metrics.stream_errors.inc((call.label, route.replica_id, "broken"))
        call.broken = True
        message = f"the engine stream broke: {why}"
        if continuable:
            call.held = message  # the forwarder continues it, or sends the error event
            return resp
        event = sse_error_event(message, code="upstream_stream_broken")
        held = strip.flush() if strip is not None else b""  # what the client would have had
        await send_to_client(request, resp, held + event, eof=True)
        return resp

    def _job_gone(self, route: Route, err: UpstreamError) -> Retry:
        """The connection broke before any byte reached the client and the replica's agent is
        gone too: the whole job is lost (its node failed, or the job was killed), which the
        request cannot have caused, so it may go to another replica (decision 0015)."""
        logger.warning("replica %s: its job is gone (its agent does not answer)", route.replica_id)
        self.router.unreachable(route)
        return Retry("job_gone", upstream_unreachable(err).response())

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamAnswer,
        route: Route,
        call: Call,
        resume: Resume | None = None,
        watch: JobWatch | None = None,
        must_finish: bool = False,
    ) -> web.StreamResponse | Retry:
        """Forward the engine's events as they arrive; the client's response starts with the
        first whole event, so a stream that dies before it is still a plain 502. With
        ``resume``, each event is noted on its way (its token ids hidden), and a break that
        could be continued returns with ``call.held`` set instead of the error event. A stream
        under way whose replica's job fell silent (``watch``) ends as a broken one does."""
        ctype = upstream.headers.get(hdrs.CONTENT_TYPE, "text/event-stream")
        relay = SseRelay() if ctype.startswith("text/event-stream") else None
        if relay is None:
            resume = None
        strip = UsageStrip() if relay is not None and call.strip_usage else None
        finish = FinishWatch() if relay is not None and must_finish else None
        rename = call.rename
        resp: web.StreamResponse | None = None
        try:
            async for chunk in upstream.chunks():
                out = relay.feed(chunk) if relay is not None else chunk
                if finish is not None:
                    out = finish.feed(out)
                if not out:
                    continue
                if resume is not None:
                    out = resume.client_events(out)
                if rename is not None:
                    out = rename(out)
                if strip is not None:
                    out = strip.feed(out)
                    if not out:
                        continue
                if resp is None:
                    resp = call.early or _stream_response(ctype, route)
                    call.first_byte_at = now = time.perf_counter()
                    self.metrics.ttft.observe((call.label,), now - call.start)
                if not await send_to_client(request, resp, out):
                    logger.debug("client went away mid-stream; closing the upstream stream")
                    upstream.close()
                    self.router.abandoned(route)
                    return resp
        except UpstreamError as err:
            if resp is None:
                if isinstance(err, UpstreamReadTimeout):
                    self.router.failed(route)
                    return upstream_timeout(err).response()
                if isinstance(err, UpstreamDropped) and await self._job_is_gone(route, watch):
                    return self._job_gone(route, err)
                self.router.failed(route)
                # The engine had the request and began to answer: a 502, never a retry.
                raise upstream_unreachable(err) from err
            self.router.failed(route)
            continuable = resume is not None and not isinstance(err, UpstreamTimeout)
            why = type(err).__name__
            return await self._broke(request, resp, route, call, strip, why, continuable)
        except asyncio.CancelledError:
            if resp is None or not _watch_cancelled(watch):
                raise  # before the first event: the attempt answers it (a retry elsewhere)
            self.router.unreachable(route)
            why, continuable = "its job is gone", resume is not None
            return await self._broke(request, resp, route, call, strip, why, continuable)
        tail = b""
        if relay is not None:
            done_marker = call.endpoint.done_marker
            if not relay.done and done_marker:
                self.metrics.stream_errors.inc((call.label, route.replica_id, "unterminated"))
            tail = relay.finish(done_marker)
            if finish is not None:
                tail = finish.feed(tail)
            if resume is not None:
                tail = resume.client_events(tail)
            if rename is not None:
                tail = rename(tail)
            if strip is not None:
                tail = strip.feed(tail) + strip.flush()
            usage = usage_of(relay.last_data)
            if usage is None and resume is not None:
                usage = resume.usage()  # counted from the token ids the stream carried
            call.usage = usage
            if usage is not None:
                self.metrics.usage(call.label, *usage)
        if resp is None:
            resp = _stream_response(ctype, route)
        if finish is not None and finish.unfinished:
            return await self._unfinished(request, resp, route, call, tail)
        self.router.succeeded(route)
        await send_to_client(request, resp, tail, eof=True)
        return resp

    async def _unfinished(
        self, request: web.Request, resp: web.StreamResponse, route: Route, call: Call, tail: bytes
    ) -> web.StreamResponse:
        """A stream that had to finish ended with ``[DONE]`` and no finished answer (vLLM's
        abort): the client is told, with an error event for the ``[DONE]``."""
        logger.warning("replica %s ended a stream without finishing its answer", route.replica_id)
        self.metrics.stream_errors.inc((call.label, route.replica_id, "unfinished"))
        self.router.failed(route)
        call.broken = True
        event = sse_error_event(
            "the engine ended the answer without finishing it", code="upstream_unfinished"
        )
        await send_to_client(request, resp, tail + event, eof=True)
        return resp

    # --- streams that outlive their engine (decision 0012) ---


def _watch_cancelled(watch: JobWatch | None) -> bool:
    """Whether the cancellation being handled is the watch's alone (then it is taken back:
    ``uncancel``); a client that left, or a worker that stops, cancels too, and then it is not."""
    task = asyncio.current_task()
    if watch is None or not watch.fired or task is None or task.cancelling() != 1:
        return False
    task.uncancel()
    return True


def _refuses_token_ids(status: int, body: Any) -> bool:
    """An engine's answer that refuses ``return_token_ids`` (``transformers serve``: 422)."""
    return status in (400, 422) and isinstance(body, bytes) and TOKEN_IDS_FIELD.encode() in body
