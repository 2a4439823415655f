"""The replica's front door for engines that cannot check an API key themselves.

Any cluster user can reach a compute node's ports, so every replica has its own secret. vLLM
checks it itself (``VLLM_API_KEY`` in its environment); other engines listen on the node's
loopback only, and this guard listens on the node's address, refuses requests without the
secret (401, OpenAI-shaped) and passes the others through, streaming, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself.
_SKIP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
    }
)


def bearer_ok(header: str | None, secret: str) -> bool:
    presented = header[7:] if header and header.startswith("Bearer ") else ""
    return hmac.compare_digest(presented.encode(), secret.encode())


def _error(status: int, message: str, type_: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _unauthorized() -> web.Response:
    return _error(
        401, "this replica requires its secret", "authentication_error", "invalid_api_key"
    )


# How long the guard waits, after the engine broke a connection, for its agent to learn that
# the job ends: Slurm signals the engine and the agent together, and the engine may go first.
ENDING_NOTICE_S = 1.0


class EngineGuard:
    """``ending``: set when the replica's job ends (its agent's SIGTERM). The engine breaking a
    connection then is the job's end, not the request's doing: a 503 that the gateway may send
    to another replica, where it would otherwise be a 502 it never sends elsewhere."""

    def __init__(self, secret: str, upstream: str, ending: asyncio.Event | None = None) -> None:
        self.ending = ending
        self.secret = secret
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not bearer_ok(request.headers.get("Authorization"), self.secret):
            return _unauthorized()
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        body = await request.read()
        try:
            up = await self.session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body
            )
        except aiohttp.ClientConnectorError as err:
            # The engine is not listening (gone, or not up): it never had the request, so
            # 503 before any byte, and the gateway may send it to another replica.
            log.warning("engine unreachable: %s", type(err).__name__)
            return _error(503, "the engine is not answering", "server_error", "engine_unavailable")
        except (aiohttp.ClientError, OSError) as err:
            if await self._job_ends():
                log.warning("engine connection broken as the job ends: %s", type(err).__name__)
                return _error(503, "the replica is stopping", "server_error", "replica_stopping")
            # The engine had the request and broke the connection before answering: it may be
            # what killed it, so a 502 that the gateway never sends elsewhere.
            log.warning("engine broke the connection: %s", type(err).__name__)
            return _error(
                502, "the engine broke the connection", "server_error", "engine_connection_broken"
            )
        async with up:
            resp = web.StreamResponse(status=up.status)
            for key, value in up.headers.items():
                if key.lower() not in _SKIP:
                    resp.headers[key] = value
            await resp.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
            except (aiohttp.ClientError, OSError):
                # Broken mid-answer: cut the connection so the client sees a broken response,
                # never a short one that looks complete.
                if request.transport is not None:
                    request.transport.abort()
                return resp
            await resp.write_eof()
            return resp

    async def _job_ends(self) -> bool:
        if self.ending is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ending.wait(), ENDING_NOTICE_S)
        return self.ending.is_set()

    async def start(self, host: str, port: int) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # Idle connections to the engine close well before uvicorn's 5 s keep-alive does, so
        # a request never goes out on a connection the engine is closing (that would be a 502).
        connector = aiohttp.TCPConnector(keepalive_timeout=2)
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=connector
        )
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
