"""Calls held through a cold start: every autoscaled model has its wake in the routing table's
``waking``; a call for it that finds no route (asleep, or its replicas starting) waits here
until a replica is READY, then goes on as any call does. So does a call whose routes all failed
before it reached an engine (their node lost, say, while the deployment scaled down): it waits
for a route it has not tried (the broker replaces a lost replica), never a 503 for want of one.

- **An honest estimate.** The broker gives when the wake began and how long its replicas take
  to serve (measured). A caller whose wait would be longer than it allows (header
  ``X-Xhpc-Max-Wait``, seconds; ``[proxy] hold_s`` at most) gets a 503 at once, with
  ``Retry-After`` from the estimate. So does every caller of a model the broker cannot wake
  (its scale was refused, the deployment failed): the reason, in the error.
- **Bounded.** ``hold_per_model`` calls per model and ``hold_per_key`` per API key are held at
  once (per worker); one more is a 503 with the estimate. A held call keeps its key's
  concurrency slot.
- **Streams stay open.** A held streamed call gets an SSE comment at once, with the estimate,
  and then every ``hold_keepalive_s`` (its 200 starts with the first), so that clients and
  proxies in between keep waiting; one more when a replica takes it, with how long it was held;
  an error then is an error event that ends the stream.
- **Nothing lost or answered twice.** A held call is sent once, to the first READY replica the
  router picks; the wake itself is the broker's (the proxies count the calls that found no
  replica, and report them at their next sync).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import hdrs, web

from xhpc.clock import monotonic, utcnow
from xhpc.models import Waking
from xhpc.proxy.calls import send_to_client
from xhpc.proxy.errors import ProxyHTTPError, sse_error_event

if TYPE_CHECKING:
    from xhpc.gateway_settings import ProxyConfig
    from xhpc.proxy.calls import Call
    from xhpc.proxy.routes.routing import Router

MAX_WAIT_HEADER = "X-Xhpc-Max-Wait"


def _unavailable(message: str, code: str, retry_s: float) -> ProxyHTTPError:
    headers = {"Retry-After": str(max(1, math.ceil(retry_s)))}
    return ProxyHTTPError(503, message, type_="service_unavailable", code=code, headers=headers)


def max_wait_of(request: web.Request, ceiling: float) -> float:
    """The caller's longest wait (its header, within ``ceiling``); a bad header is a 400."""
    raw = request.headers.get(MAX_WAIT_HEADER)
    if raw is None:
        return ceiling
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e9:  # also NaN
        raise ProxyHTTPError(
            400,
            f"{MAX_WAIT_HEADER} must be a number of seconds, 0 or more",
            type_="invalid_request_error",
            code="invalid_max_wait",
        )
    return min(value, ceiling)


class Holds:
    """The calls this worker holds, per model and per key."""

    def __init__(self, router: Router, config: ProxyConfig) -> None:
        self.router = router
        self.config = config
        self.per_model: dict[str, int] = router.held  # the router reports it to the brokers
        self.per_key: dict[str, int] = {}
        self.held_total = 0  # calls ever held (for the metrics)

    def eta_s(self, waking: Waking) -> float:
        """The estimate a caller is given: the broker's, plus this gateway's sync interval
        while the model sleeps (the broker hears of the call at the next sync)."""
        return waking.eta_s(utcnow(), self.config.refresh_interval_s)

    def waking(self, model: str) -> Waking | None:
        """The model's wake, while it has no route (None: it has one, or is not autoscaled)."""
        if self.router.routes(model):
            return None
        return self.router.table.waking.get(model)

    def holds_for(self, model: str) -> bool:
        """Whether a call for ``model`` that finds no usable route is held (autoscaled)."""
        return model in self.router.table.waking

    async def until_routed(
        self,
        request: web.Request,
        call: Call,
        model: str,
        stream: bool,
        tried: Mapping[str, str] | None = None,
    ) -> None:
        """Return once ``model`` has a route the router may pick that the call has not tried
        (``tried``: replica id -> url; ``Router.excluded``); else raise the 503 to answer (the
        caller waited what it allowed, or could not be held)."""
        waking = self.router.table.waking.get(model)
        assert waking is not None
        if waking.failed:
            self.router.unserved(model)  # refused at once: counted for a wake (next sync)
            raise _unavailable(
                f"model {model!r} cannot be started now: {waking.failed}", "wake_failed",
                self.config.retry_after_s,
            )  # fmt: skip
        eta = self.eta_s(waking)
        began = monotonic()
        if call.held_since is None:
            call.held_since = began
        # Held more than once (its new route failed too): one wait in all, from the first.
        allowed = max(0.0, max_wait_of(request, self.config.hold_s) - (began - call.held_since))
        if eta > allowed:
            self.router.unserved(model)
            raise _unavailable(
                f"model {model!r} has no replica READY; one should serve in about "
                f"{math.ceil(eta)} s, longer than this call waits ({round(allowed, 1):g} s)",
                "model_waking",
                eta,
            )
        key = call.grant.key_id if call.grant is not None else ""
        if (
            self.per_model.get(model, 0) >= self.config.hold_per_model
            or self.per_key.get(key, 0) >= self.config.hold_per_key
        ):
            self.router.unserved(model)
            raise _unavailable(
                f"model {model!r} has no replica READY and too many calls wait for one",
                "too_many_held",
                eta,
            )
        # Held: counted as held (a level the gateway reports at each sync), not as unserved,
        # so that one call is one call of demand.
        self.per_model[model] = self.per_model.get(model, 0) + 1
        self.per_key[key] = self.per_key.get(key, 0) + 1
        self.held_total += 1
        try:
            await self._wait(request, call, model, stream, allowed, tried or {})
            if call.early is not None:  # a held stream learns how long it was held
                held = f": a replica of {model} is ready (held {monotonic() - began:.1f} s)\n\n"
                await call.early.write(held.encode())
        finally:
            self.per_model[model] -= 1
            self.per_key[key] -= 1
            if not self.per_model[model]:
                del self.per_model[model]
            if not self.per_key[key]:
                del self.per_key[key]

    async def _wait(
        self,
        request: web.Request,
        call: Call,
        model: str,
        stream: bool,
        allowed: float,
        tried: Mapping[str, str],
    ) -> None:
        router = self.router
        deadline = monotonic() + allowed
        tick = self.config.hold_keepalive_s
        next_tick = monotonic()  # the first comment at once: the caller learns the estimate
        while True:
            if router.usable(model, router.excluded(tried)):
                return
            if not router.knows(model):
                raise _unavailable(
                    f"model {model!r} was stopped while this call waited", "model_stopped",
                    self.config.retry_after_s,
                )  # fmt: skip
            waking = router.table.waking.get(model)
            if waking is None:  # no longer autoscaled: answered as any call without a route
                raise _unavailable(
                    f"model {model!r} has no replica READY", "no_ready_replica",
                    self.config.retry_after_s,
                )  # fmt: skip
            if waking.failed:
                raise _unavailable(
                    f"model {model!r} cannot be started now: {waking.failed}", "wake_failed",
                    self.config.retry_after_s,
                )  # fmt: skip
            now = monotonic()
            if now >= deadline:
                eta = self.eta_s(waking)
                waited = round(allowed, 1)
                raise _unavailable(
                    f"model {model!r} had no replica READY within {waited:g} s", "model_waking",
                    eta,
                )  # fmt: skip
            if stream and now >= next_tick:
                await keep_alive(request, call, model, self.eta_s(waking))
                next_tick = now + tick
            # A table update wakes it; so does, within a second, a breaker's cool-down ending.
            wait = min(deadline, next_tick if stream else deadline, now + 1.0) - now
            await router.changed(max(0.05, wait))


async def keep_alive(request: web.Request, call: Call, model: str, eta_s: float | None) -> None:
    """An SSE comment to a held streamed call (its 200 response starts with the first)."""
    resp = call.early
    if resp is None:
        headers = {hdrs.CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache"}
        resp = call.early = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
    eta = f" (about {math.ceil(eta_s)} s)" if eta_s is not None else ""
    await resp.write(f": waiting for a replica of {model}{eta}\n\n".encode())


async def end_early(
    request: web.Request, call: Call, message: str, code: str, status: int
) -> web.StreamResponse:
    """A held streamed call whose response started, then failed (its wait ran out, or the
    engine answered an error): the error as the stream's last event, no ``[DONE]``."""
    resp = call.early
    assert resp is not None
    call.broken = True
    event = sse_error_event(f"{message} (HTTP {status})", code=code)
    await send_to_client(request, resp, event, eof=True)
    return resp


def answer_message(resp: web.StreamResponse) -> str:
    """The message of an answer's OpenAI-shaped error body (else its status)."""
    body = resp.body if isinstance(resp, web.Response) else None
    if isinstance(body, bytes):
        try:
            data = json.loads(body)
            return str(data["error"]["message"])[:500]
        except (ValueError, KeyError, TypeError):
            pass
    return f"the engine answered HTTP {resp.status}"
