"""One call to a broker's control socket: who answered it, and at most so many bytes of it.

A lab gateway reads brokers it does not trust (decision 0014: each member's), so every call
opens its own connection to the broker's Unix socket, sends one HTTP/1.1 request (``Connection:
close``) and reads the answer by ``xhpc.proxy.engines.http1``'s grammar and limits, its body at most
``max_bytes`` long: a larger answer (a ``Content-Length`` over the limit, or a body that grows
past it) is a ``BrokerError`` (``answer_too_large``) the moment it is seen, never buffered
whole. The answer carries the peer credentials (``SO_PEERCRED``) of that very connection: the
uid of the process listening where these bytes came from, not of a connection made before or
after it (a socket path swapped in between cannot lend one broker's answer to another uid).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from xhpc.errors import BrokerError, BrokerUnavailableError
from xhpc.paths import reachable_socket
from xhpc.peers import peer_uid
from xhpc.proxy.engines.http1 import AnswerParser, MalformedAnswer
from xhpc.wire import WIRE_HEADER, WIRE_VERSION

MAX_ANSWER = 16 * 1024 * 1024  # a routing table or grants: tens of thousands of rows
READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class BrokerAnswer:
    status: int
    body: bytes
    uid: int | None  # who listens on the socket the answer came from (None: not known)


class _TooLarge(Exception):
    pass


class _Answer(AnswerParser):
    """The answer's body, refused past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False

    def _on_head(self) -> None:
        length = self.headers.get("Content-Length")
        if length is not None and int(length) > self.max_bytes:
            raise _TooLarge(f"it announces {length} bytes")

    def _on_body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise _TooLarge(f"it sent more than {self.max_bytes} bytes")
        self.chunks.append(data)

    def _on_done(self) -> None:
        self.done = True


def _request(method: str, target: str, body: bytes | None) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n"
    head += f"{WIRE_HEADER}: {WIRE_VERSION}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + (body or b"")


async def call(
    path: Path,
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    timeout_s: float,
    max_bytes: int = MAX_ANSWER,
) -> BrokerAnswer:
    """``method target`` on the broker listening at ``path``: BrokerUnavailableError when it
    cannot be reached or does not answer in ``timeout_s``; BrokerError for an answer outside
    HTTP/1.1 or over ``max_bytes``. Any status is an answer."""
    answer = _Answer(max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(
                str(reachable_socket(path)), limit=READ_SIZE
            )
            try:
                uid = peer_uid(writer.get_extra_info("socket"))
                writer.write(_request(method, target, body))
                await writer.drain()
                while not answer.done:
                    data = await reader.read(READ_SIZE)
                    if not data:
                        if answer.eof():
                            break
                        raise ConnectionResetError("the broker closed before its answer ended")
                    answer.feed(data)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except _TooLarge as err:
        raise BrokerError(
            f"the broker at {path} sent too large an answer to {method} {target} ({err}; "
            f"the limit is {max_bytes} bytes)",
            status=answer.status,
            code="answer_too_large",
        ) from None
    except MalformedAnswer as err:
        raise BrokerError(
            f"the broker at {path} sent a malformed answer to {method} {target}: {err}",
            status=0,
            code="malformed_answer",
        ) from err
    except (TimeoutError, OSError) as err:
        raise BrokerUnavailableError(
            f"cannot reach the broker at {path}: {type(err).__name__}: {err}",
            hint="is `xhpc broker` running?",
        ) from err
    return BrokerAnswer(answer.status, b"".join(answer.chunks), uid)
