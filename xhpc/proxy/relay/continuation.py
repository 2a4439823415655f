"""Streams that go on after their engine died (decision 0012): the forwarder's continuation.

A stream asked to be continued (``[proxy] continue_streams`` or ``X-Xhpc-Continue: 1``) whose
output can be continued exactly is tracked on its way (``xhpc.proxy.relay.resume``); when its engine
dies after the client got bytes, ``go_on`` picks another READY replica (never one tried before)
and asks it for the rest from the prompt plus the token ids already sent, relaying its events
into the client's stream, at most ``max_continuations`` times; else the stream ends with the
error event it would have had.
"""

from __future__ import annotations

import logging

from aiohttp import web

from xhpc.models import Route
from xhpc.proxy.calls import Call, send_to_client, upstream_headers
from xhpc.proxy.engines.contexts import ContextLengths
from xhpc.proxy.engines.upstream_api import Timeouts, Upstream, UpstreamError, UpstreamReadTimeout
from xhpc.proxy.errors import NoReadyReplicaError, UnknownModelError, sse_error_event
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.relay.body import RequestBody
from xhpc.proxy.relay.resume import CHAT_PATH, COMPLETIONS_PATH, Resume, refusal, wanted
from xhpc.proxy.relay.resume import HEADER as CONTINUE_HEADER
from xhpc.proxy.relay.sse import SseRelay
from xhpc.proxy.routes.policies import RequestInfo
from xhpc.proxy.routes.routing import Router
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)


def renamed(call: Call, data: bytes) -> bytes:
    """A continuation's events carry the first engine's model name: the client's name."""
    return data if call.rename is None else call.rename(data)


class Continuation:
    """Continues broken streams for one forwarder (its router, upstream and metrics);
    ``no_token_ids``: the replicas found to refuse token ids (shared with the forwarder)."""

    def __init__(
        self,
        router: Router,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        upstream: Upstream,
        contexts: ContextLengths,
        stream_timeout: Timeouts,
        no_token_ids: set[str],
    ) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics
        self.upstream = upstream
        self.contexts = contexts
        self.stream_timeout = stream_timeout
        self.no_token_ids = no_token_ids

    def tracked(self, request: web.Request, req: RequestBody) -> Resume | None:
        """The bookkeeping that lets this stream go on elsewhere, if it is wanted and its
        output can be continued exactly."""
        if not wanted(self.config.continue_streams, request.headers.get(CONTINUE_HEADER)):
            return None
        chat = request.path == CHAT_PATH
        if not chat and request.path != COMPLETIONS_PATH:
            return None
        data = req.data
        why = refusal(data, chat)
        if why is not None:
            logger.debug("stream not continuable (%s)", why)
            return None
        return Resume(data, chat)

    async def go_on(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        resume: Resume,
        model: str,
        info: RequestInfo | None,
        tried: list[str],
        call: Call,
    ) -> web.StreamResponse:
        """A stream whose engine died after the client got bytes: go on on other replicas
        (never one tried before), at most ``max_continuations`` times; else the error event."""
        router = self.router
        message = call.held or "the engine stream broke"
        call.held = None
        while (
            not resume.complete
            and resume.can_continue
            and resume.legs < self.config.max_continuations
        ):
            try:
                route = router.pick(model, info, exclude=[*tried, *self.no_token_ids])
            except (UnknownModelError, NoReadyReplicaError):
                resume.stop("no other ready replica")
                break
            resume.legs += 1
            tried.append(route.replica_id)
            call.replica = route.replica_id
            self.metrics.retries.inc((call.label, "stream_continued"))
            logger.info(
                "continuing a stream on %s after %s broke (%d tokens sent)",
                route.replica_id,
                tried[-2],
                len(resume.ids),
            )
            router.acquire(route)
            try:
                if await self._leg(request, resp, resume, route, call):
                    return resp  # the client left
            finally:
                router.release(route)
        if resume.complete:
            call.broken = False
            call.usage = usage = resume.usage()
            if usage is not None:
                self.metrics.usage(call.label, *usage)
            await send_to_client(request, resp, renamed(call, resume.closing()), eof=True)
            return resp
        why = resume.why or ("no token ids" if resume.prompt_ids is None else "")
        if not why:
            why = f"{self.config.max_continuations} continuation(s) spent"
        logger.info("stream not continued: %s", why)
        event = sse_error_event(message, code="upstream_stream_broken")
        await send_to_client(request, resp, event, eof=True)
        return resp

    async def _leg(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        resume: Resume,
        route: Route,
        call: Call,
    ) -> bool:
        """One continuation on ``route``, relayed into the client's stream; True if the
        client left. A failure leaves ``resume`` as far as the client got."""
        router = self.router
        context_len = await self.contexts.of(route) if resume.needs_context_length else None
        body = resume.continuation_body(route.served_model, context_len)
        if body is None:
            resume.stop("no budget left to ask for")
            router.abandoned(route)
            return False
        relay = SseRelay()
        url = route.url.rstrip("/") + COMPLETIONS_PATH
        try:
            async with self.upstream.post(
                url, data=body, headers=upstream_headers(route), timeout=self.stream_timeout
            ) as upstream:
                if upstream.status != 200:
                    await upstream.read()
                    if upstream.status >= 500:
                        router.failed(route)
                    else:  # not the replica's fault; and asking again gets the same answer
                        router.succeeded(route)
                        resume.stop(f"the continuation was refused ({upstream.status})")
                    return False
                async for chunk in upstream.chunks():
                    out = relay.feed(chunk)
                    if out and not await send_to_client(
                        request, resp, renamed(call, resume.leg_events(out))
                    ):
                        upstream.close()
                        router.abandoned(route)
                        return True
        except UpstreamReadTimeout:
            router.failed(route)
            resume.stop("the continuation timed out")
            return False
        except UpstreamError as err:  # a connect error or timeout, a drop, a broken answer
            name = type(err).__name__
            logger.warning("replica %s continuation broke: %s", route.replica_id, name)
            self.metrics.stream_errors.inc((call.label, route.replica_id, "broken"))
            router.failed(route)
            return False
        router.succeeded(route)
        tail = renamed(call, resume.leg_events(relay.finish()))
        return bool(tail) and not await send_to_client(request, resp, tail)
