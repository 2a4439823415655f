"""One client request on its way to engines: what the single-phase route
(``xhpc.proxy.forward``) and the prefill/decode route (``xhpc.proxy.pd``) share.

``Call`` is a request's bookkeeping from its arrival to its answer (its key, the replica that
answered, the engine's usage, whether its stream broke); ``Retry`` is an attempt that failed
before the client got a byte, with the answer to give if it is not sent elsewhere. What goes
to every engine (``upstream_headers``) and how a body answer comes back (``relay_body``) are
the same on both routes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from aiohttp import hdrs, web

from xhpc.access import KeyGrant
from xhpc.endpoints import CHAT, Endpoint
from xhpc.models import Route
from xhpc.proxy.engines.upstream_api import UpstreamAnswer
from xhpc.proxy.relay.answers import Renamer
from xhpc.proxy.relay.sse import Usage
from xhpc.proxy.tenants.quota import Hold

SESSION_HEADER = "X-Session-Id"  # on requests: the client's session, for affinity
REPLICA_HEADER = "X-Xhpc-Replica"  # on answers: the replica that answered (a stream's first)
JSON_HEADERS: dict[str, str] = {"Content-Type": "application/json"}


def upstream_headers(route: Route) -> Mapping[str, str]:
    """The replica's own secret goes with every request to it (its engine requires it)."""
    if route.secret is None:
        return JSON_HEADERS
    return {"Content-Type": "application/json", "Authorization": f"Bearer {route.secret}"}


class Retry(NamedTuple):
    """An attempt failed before the client got a byte; ``response`` answers if no retry."""

    reason: str
    response: web.Response


@dataclass(slots=True)
class Call:
    """One client request's bookkeeping: for metrics, its key's usage, and its stream."""

    start: float
    label: str = ""  # the model, if it is in the table
    replica: str = ""  # the last replica tried
    status: int = 500
    grant: KeyGrant | None = None  # the caller's API key (None: keys are not required)
    usage: Usage | None = None  # the engine's token counts, when it gave them
    first_byte_at: float | None = None  # when a stream's first event went to the client
    broken: bool = False  # the stream broke after the client got bytes
    held: str | None = None  # a break's error message, held back while it may be continued
    hold: Hold | None = None  # what it holds of its key's limits (slot, reserved tokens)
    strip_usage: bool = False  # the engine was asked for a usage chunk the client was not
    rename: Renamer | None = None  # the public model name for the first engine's
    endpoint: Endpoint = CHAT  # the path's (what its streams end with)
    # A held streamed call's response, started to keep it open (xhpc.proxy.routes.holding):
    # the engine's stream goes on in it, and an error ends it as an error event.
    early: web.StreamResponse | None = None
    held_since: float | None = None  # when it was first held (monotonic): its wait counts from it


async def relay_body(
    upstream: UpstreamAnswer, replica: str, rename: Renamer | None = None
) -> web.Response:
    """The engine's status, body and content type, as they are (an answer's model renamed),
    naming ``replica``. Raises the upstream's errors when the body cannot be read whole."""
    data = await upstream.read()
    if rename is not None and upstream.status == 200:
        data = rename(data)
    headers = {
        hdrs.CONTENT_TYPE: upstream.headers.get(hdrs.CONTENT_TYPE, "application/json"),
        REPLICA_HEADER: replica,
    }
    if hdrs.RETRY_AFTER in upstream.headers:
        headers[hdrs.RETRY_AFTER] = upstream.headers[hdrs.RETRY_AFTER]
    return web.Response(status=upstream.status, body=data, headers=headers)


async def send_to_client(
    request: web.Request, resp: web.StreamResponse, data: bytes, *, eof: bool = False
) -> bool:
    """Write to the client (starting the response if needed); False if the client left."""
    try:
        if not resp.prepared:
            await resp.prepare(request)
        if data:
            await resp.write(data)
        if eof:
            await resp.write_eof()
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        return False
    return True
