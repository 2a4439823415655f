"""The relay: the socket of a standby broker whose leader runs on another login node.

A Unix socket does not cross hosts, so on two login nodes that share a state (a PostgreSQL
database, the state directory on a shared filesystem) the callers of the login node that does
not lead (its gateway, its users' CLI) would reach no broker. Every broker therefore serves a
socket of its own login node (``xhpc.paths.host_socket_path``), which clients prefer
(``reachable_socket``): the leader its control API, a standby this relay, which passes each
call on to the leader's control API over TCP (``control_url`` in broker.json) and its answer
back.

The leader must know who called: the relay names the caller's uid, read from its socket's peer
credentials, and signs the call with a key the brokers of the state share and nothing else
reads (``secrets`` in the database, which jobs do not reach; the control token, which jobs
hold, gives member rights only and cannot sign). The leader verifies the signature (an HMAC
over the uid, a nonce, the time, the method, the path, the headers that act and the body),
refuses a nonce it has seen or a time off by more than ``WINDOW_S``, and then treats the call
as one from that uid on its own socket (admins, proxy users, members: the same rules). It
signs its answer over the call's nonce, its status and its body; the relay passes on no
answer without that signature, so whoever took the leader's port after it died learns nothing
of use and cannot answer in its name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from xhpc.access import ACTING_KEY_HEADER, ACTING_USER_HEADER
from xhpc.peers import peer_uid
from xhpc.wire import WIRE_HEADER

log = logging.getLogger(__name__)

RELAY_HEADER = "X-Xhpc-Relay"  # on a relayed call: "<uid> <nonce> <unix time> <mac>"
ANSWER_HEADER = "X-Xhpc-Relay-Answer"  # on the leader's answer: its mac
SECRET_NAME = "relay"  # the shared key's name in the state's ``secrets``
WINDOW_S = 60.0  # a relayed call's time, off the leader's clock by more: refused
# The headers a relayed call carries on (and signs): who it acts for, its wire, its body's type.
CARRIED = (WIRE_HEADER, ACTING_USER_HEADER, ACTING_KEY_HEADER, "Content-Type")
CONNECT_S = 3.0  # a leader whose host is down refuses nothing: given up on after this long
CALL_S = 600.0  # the longest call the relay waits for (a proxy's long poll is far shorter)
MAX_ANSWER = 64 * 1024 * 1024


# The calls whose body the broker reads as it comes (a batch's input, uploaded): the relay
# passes it on as it is read, and the signature covers its length (the server reads exactly it).
STREAMED = frozenset({"/v1/batch-inputs"})


def body_digest(body: bytes | int) -> str:
    """What a relayed call's signature covers of its body: its SHA-256, or for a streamed one
    its length (checked by the server as it reads)."""
    if isinstance(body, int):
        return f"length:{body}"
    return hashlib.sha256(body).hexdigest()


class RelayRefused(PermissionError):
    """A call that claims to be relayed and is not signed by a broker of this state."""


class RelayKey:
    """The key the brokers of one state share: signs and checks relayed calls and answers."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()

    def call_mac(
        self,
        uid: int,
        nonce: str,
        at: int,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: str,
    ) -> str:
        """``body``: ``body_digest`` of the body, as sent."""
        carried = [f"{name.lower()}:{headers.get(name, '')}" for name in CARRIED]
        return self._mac("call", str(uid), nonce, str(at), method, target, *carried, body)

    def answer_mac(self, nonce: str, status: int, body: bytes) -> str:
        return self._mac("answer", nonce, str(status), hashlib.sha256(body).hexdigest())


@dataclass
class Nonces:
    """The nonces of the relayed calls of the last ``2 * WINDOW_S``: a call seen once is refused
    the second time (replayed by whoever read it on the network)."""

    seen: dict[str, float] = field(default_factory=dict)

    def first(self, nonce: str, now: float) -> bool:
        if len(self.seen) > 65536:  # pruned when large (only signed calls are recorded)
            self.seen = {n: t for n, t in self.seen.items() if now - t < 2 * WINDOW_S}
        if nonce in self.seen:
            return False
        self.seen[nonce] = now
        return True


@dataclass(frozen=True)
class Relayed:
    """A relayed call the leader verified: the uid it names, and its nonce (the answer's)."""

    uid: int
    nonce: str


async def verify(request: web.Request, key: RelayKey, nonces: Nonces) -> Relayed:
    """The relayed call ``request`` as the leader checks it (its body read whole, unless it is
    one of ``STREAMED``); RelayRefused, never echoing what it carried, unless a broker of this
    state signed it just now and it was not seen before."""
    words = request.headers.get(RELAY_HEADER, "").split(" ")
    if (
        len(words) != 4
        or not all(w.isascii() and w for w in words)
        or not (words[0].isdigit() and words[2].isdigit())
    ):
        raise RelayRefused("a relayed call must be signed by a broker of this state")
    uid, nonce, at, mac = int(words[0]), words[1], int(words[2]), words[3]
    length = request.content_length
    if request.path not in STREAMED:
        digest = body_digest(await request.read())
    elif length is not None:
        digest = body_digest(length)
    else:
        raise RelayRefused("a relayed upload must name its length")
    expected = key.call_mac(
        uid, nonce, at, request.method, request.raw_path, request.headers, digest
    )
    if not hmac.compare_digest(mac, expected):
        raise RelayRefused("a relayed call must be signed by a broker of this state")
    now = time.time()
    if abs(now - at) > WINDOW_S:
        raise RelayRefused(
            f"a relayed call made {now - at:.0f}s from now: the login nodes' clocks differ "
            "(they must be in step, as for the lease)"
        )
    if not nonces.first(nonce, now):
        raise RelayRefused("a relayed call was sent again: refused")
    return Relayed(uid, nonce)


def sign_answer(
    request: web.Request, response: web.StreamResponse, key: RelayKey, relayed: Relayed
) -> None:
    """Sign the leader's answer to a relayed call (every control answer is a whole body; the
    answer to a HEAD carries none)."""
    body = response.body if isinstance(response, web.Response) else None
    data = body if isinstance(body, bytes) and request.method != "HEAD" else b""
    response.headers[ANSWER_HEADER] = key.answer_mac(relayed.nonce, response.status, data)


def leader_url(broker_file: Path) -> str | None:
    """The leader's control API over TCP from its broker.json, if it takes relayed calls."""
    try:
        found = json.loads(broker_file.read_text())
    except (OSError, ValueError):
        return None
    url = found.get("control_url") if isinstance(found, dict) else None
    return str(url) if isinstance(url, str) and found.get("relay") is True else None


def _unavailable(message: str, hint: str) -> web.Response:
    body = {"code": "broker_unavailable", "message": message, "hint": hint}
    return web.json_response({"error": body}, status=503)


def relay_app(broker_file: Path, key: RelayKey, max_body: int) -> web.Application:
    """The relay's app, on the standby's socket: every call goes to the leader named in
    ``broker_file``, signed for the uid at the other end of the socket."""
    app = web.Application(client_max_size=max_body)
    sessions: list[aiohttp.ClientSession] = []

    async def open_session(_: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=CALL_S, sock_connect=CONNECT_S)
        sessions.append(aiohttp.ClientSession(timeout=timeout, auto_decompress=False))

    async def close_session(_: web.Application) -> None:
        for session in sessions:
            await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        uid = peer_uid(sock)
        if uid is None:
            raise web.HTTPForbidden(text="the relay serves its Unix socket only")
        leader = leader_url(broker_file)
        if leader is None:
            return _unavailable(
                "the leading broker takes no relayed calls (not running, an older xhpc, or "
                "broker.remote_control off)",
                "start the broker on the login node that leads, or call it there",
            )
        length = request.content_length
        body: bytes | aiohttp.StreamReader | None
        if request.path in STREAMED:
            if length is None:
                raise web.HTTPLengthRequired(text="an upload through the relay names its length")
            body, digest = request.content, body_digest(length)
            headers = {"Content-Length": str(length)}
        else:
            read = await request.read()
            digest, headers = body_digest(read), {}
            body = read or None  # none: no Content-Type added by the client (it is signed)
        target = request.raw_path
        headers |= {name: request.headers[name] for name in CARRIED if name in request.headers}
        nonce, at = secrets.token_hex(16), int(time.time())
        mac = key.call_mac(uid, nonce, at, request.method, target, headers, digest)
        headers[RELAY_HEADER] = f"{uid} {nonce} {at} {mac}"
        try:
            async with sessions[0].request(
                request.method, URL(leader + target, encoded=True), data=body, headers=headers
            ) as resp:
                answer = await resp.content.read(MAX_ANSWER + 1)
                status, signed = resp.status, resp.headers.get(ANSWER_HEADER, "")
                signed = signed if signed.isascii() else ""
                kind = resp.headers.get("Content-Type", "application/json")
                wire = resp.headers.get(WIRE_HEADER)
        except (aiohttp.ClientError, TimeoutError) as err:
            return _unavailable(
                f"cannot reach the leading broker at {leader}: {type(err).__name__}",
                "its login node may be down: a standby takes over within the lease",
            )
        if len(answer) > MAX_ANSWER or not hmac.compare_digest(
            signed, key.answer_mac(nonce, status, answer)
        ):
            log.warning("relay: an answer from %s (%d) not signed by a broker of this state",
                        leader, status)  # fmt: skip
            return _unavailable(
                f"the answer from {leader} is not signed by a broker of this state",
                "another process holds the leader's port: the leader is down",
            )
        out = web.Response(status=status, body=answer, headers={"Content-Type": kind})
        if wire is not None:
            out.headers[WIRE_HEADER] = wire
        return out

    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app
