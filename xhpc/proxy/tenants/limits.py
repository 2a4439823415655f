"""What the gateway allows one client: time to send a request, request body sizes per path,
connections per worker, and the process's descriptor limit that those connections need
(decision 0013).

``ClientLimits`` is read once from ``[proxy]``; ``xhpc.proxy.process.listener`` enforces the
timeouts and the connection cap, ``read_body`` the body limits.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from aiohttp import web

from xhpc.proxy.errors import ProxyHTTPError, too_large
from xhpc.settings import ProxyConfig

logger = logging.getLogger(__name__)

# Descriptors a worker needs besides its clients' connections: the listening and metrics
# sockets, pipes, the broker's socket, log and metrics files.
RESERVED_FDS = 64
# A client's connection may hold one engine connection while its request is forwarded.
FDS_PER_CONNECTION = 2
FD_LIMIT_IF_UNLIMITED = 1 << 20  # Linux refuses an unlimited RLIMIT_NOFILE


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """How long a client may take and how many may connect (``[proxy]``; decision 0013)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 60.0
    max_connections: int = 4096  # per worker process

    @classmethod
    def of(cls, config: ProxyConfig) -> ClientLimits:
        return cls(
            header_timeout_s=config.client_header_timeout_s,
            body_timeout_s=config.client_body_timeout_s,
            keepalive_timeout_s=config.client_keepalive_timeout_s,
            max_connections=config.max_connections,
        )

    @property
    def sweep_s(self) -> float:
        """How often the deadlines are checked: a deadline is met within this much."""
        return max(0.01, min(1.0, self.header_timeout_s / 4, self.body_timeout_s / 4))

    def within_fds(self, fd_limit: int) -> ClientLimits:
        """These limits with ``max_connections`` lowered to what ``fd_limit`` descriptors
        carry: a worker out of descriptors cannot accept at all, not even to say 503."""
        fits = max(1, (fd_limit - RESERVED_FDS) // FDS_PER_CONNECTION)
        if self.max_connections <= fits:
            return self
        logger.warning(
            "proxy.max_connections = %d needs %d file descriptors, but this process may open "
            "%d; serving at most %d connections (raise the hard limit: ulimit -Hn)",
            self.max_connections,
            self.max_connections * FDS_PER_CONNECTION + RESERVED_FDS,
            fd_limit,
            fits,
        )
        return ClientLimits(
            self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s, fits
        )


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit
    in force after. Login nodes often start processes at 1024 while allowing far more, and
    every client connection is a descriptor (two while forwarded)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT_IF_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            logger.warning(
                "could not raise the open-files limit from %d to %d: %s", soft, target, err
            )
        else:
            soft = target
    return FD_LIMIT_IF_UNLIMITED if soft == resource.RLIM_INFINITY else soft


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's whole body; 413 as soon as it is known to be over ``limit`` bytes: from
    its Content-Length before a byte of it is read, else (chunked) once it has passed it."""
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(limit)
    content = request.content
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except (ConnectionError, web.RequestPayloadError) as err:
        # the client left, or its body broke HTTP/1.1: no traceback, nobody may read the answer
        raise ProxyHTTPError(
            400,
            f"the request body could not be read ({type(err).__name__})",
            type_="invalid_request_error",
            code="invalid_request_body",
        ) from err
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
