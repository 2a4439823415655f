"""What each engine accepts: its context length (``max_model_len``).

The agent asks its engine (``GET /v1/models``; vLLM states it) and registers it, and the broker
puts it in the replica's route. A stream continued on a replica whose route does not say asks
the engine itself (vLLM's ``POST /tokenize``), once. The gateway uses it three ways: ``GET
/v1/models`` shows it under the public model name; a stream continued on another replica is
sized by it (decision 0012); and a request whose body is larger than any prompt the model could
take (``[proxy] bytes_per_context_token`` bytes per token of context, plus a margin for the rest
of the body) is refused with a 400 before any engine sees it. Engines that do not state it
(transformers, commands) get no such check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping

from xhpc.models import Route
from xhpc.proxy.engines.upstream_api import Timeouts, Upstream, UpstreamError
from xhpc.proxy.errors import ProxyHTTPError

logger = logging.getLogger(__name__)

PROBE_S = 10.0  # asking an engine for its context length (POST /tokenize)
BODY_MARGIN_BYTES = 64 * 1024  # the rest of a body: messages' structure, sampling fields, tools
KEPT = 4096  # replicas remembered at most
PROBE_TIMEOUTS = Timeouts(total=PROBE_S)


def context_too_long(model: str, max_model_len: int, limit: int) -> ProxyHTTPError:
    return ProxyHTTPError(
        400,
        f"the request ({limit} bytes allowed) cannot fit model {model!r}'s context of "
        f"{max_model_len} tokens",
        type_="invalid_request_error",
        code="context_length_exceeded",
    )


class ContextLengths:
    """The replicas' context lengths, each asked of its engine once."""

    def __init__(
        self,
        upstream: Upstream,
        headers: Callable[[Route], Mapping[str, str]],
        bytes_per_token: int,
    ) -> None:
        self.upstream = upstream
        self.headers = headers
        self.bytes_per_token = bytes_per_token
        self.known: dict[str, int] = {}  # replica -> its engine's max_model_len
        self._asking: dict[str, asyncio.Task[int | None]] = {}

    async def of(self, route: Route) -> int | None:
        """The replica's ``max_model_len``; asks its engine the first time (one at a time)."""
        known = self.length(route)
        if known is not None:
            return known
        return await asyncio.shield(self._start(route))

    def _start(self, route: Route) -> asyncio.Task[int | None]:
        rid = route.replica_id
        task = self._asking.get(rid)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._ask(route))
            self._asking[rid] = task
            task.add_done_callback(lambda _: self._asking.pop(rid, None))
        return task

    def length(self, route: Route) -> int | None:
        """What is known of the replica's context length: the broker's word (its agent asked
        the engine), else a probe's answer."""
        return route.max_model_len or self.known.get(route.replica_id)

    def check(self, route: Route, body_bytes: int) -> None:
        """Refuse a body no prompt within the model's context could need (a 400)."""
        known = self.length(route)
        if self.bytes_per_token <= 0 or known is None:
            return
        limit = known * self.bytes_per_token + BODY_MARGIN_BYTES
        if body_bytes > limit:
            raise context_too_long(route.model, known, limit)

    def model_len(self, routes: tuple[Route, ...]) -> int | None:
        """The context length a model's replicas agree on (the least), if any is known."""
        lens = [n for r in routes if (n := self.length(r)) is not None]
        return min(lens) if lens else None

    async def _ask(self, route: Route) -> int | None:
        url = route.url.rstrip("/") + "/tokenize"
        body = json.dumps({"model": route.served_model, "prompt": ""}).encode()
        try:
            async with self.upstream.post(
                url, data=body, headers=self.headers(route), timeout=PROBE_TIMEOUTS
            ) as upstream:
                raw = await upstream.read()
                if upstream.status != 200:
                    return None
            value = json.loads(raw).get("max_model_len")
        except (UpstreamError, ValueError, AttributeError):
            return None
        if type(value) is not int or value < 1:
            return None
        if len(self.known) >= KEPT:
            self.known.clear()
        self.known[route.replica_id] = value
        return value
