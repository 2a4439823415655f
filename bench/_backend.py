"""A fast OpenAI-shaped backend for bench/proxy.py, and the stand-in broker socket.

Raw asyncio (no framework), prepared answers, so that it costs a few microseconds per request and
never dominates what the benchmark measures.

    POST /v1/chat/completions               a fixed chat.completion (Content-Length, keep-alive)
    POST /v1/chat/completions, stream:true  ``events(tokens)``: a role chunk, ``tokens - 1``
                                            content chunks, a finish chunk, a usage chunk, and
                                            ``data: [DONE]``; the first at once, each next one
                                            ``--interval-ms`` later; chunked transfer encoding;
                                            while the ``--hold-file`` exists, a stream holds its
                                            last event back (a test ends streams when it wants)
    GET  /health, /v1/models                small JSON answers

With ``--broker-socket`` it also stands in for the broker on that UNIX socket: a ``POST`` to a
path in the ``--broker-answers`` file (a JSON object: path -> the JSON to answer, e.g. the
routing table for ``/v1/proxy/sync`` and the key grants for ``/v1/proxy/grants``, which the xhpc
proxy polls) gets that answer, so that the real proxy process runs without a broker.

    python bench/_backend.py --port 0 --ready-file F [--broker-socket S --broker-answers FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
from pathlib import Path

from _http import decode_chunked

MODEL = "bench-model"
CREATED = 1_764_000_000
COMPLETION_ID = "chatcmpl-bench0000000000000000000000"

_COMPLETION = {
    "id": COMPLETION_ID,
    "object": "chat.completion",
    "created": CREATED,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
}
COMPLETION_BODY = json.dumps(_COMPLETION, separators=(",", ":")).encode()


def _chunk(delta: dict[str, object], finish: str | None) -> dict[str, object]:
    return {
        "id": COMPLETION_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def events(tokens: int) -> list[bytes]:
    """The SSE events of one streamed answer of ``tokens`` tokens, each ending in a blank line."""
    out = [_chunk({"role": "assistant", "content": ""}, None)]
    out += [_chunk({"content": f" tok{i}"}, None) for i in range(1, tokens)]
    out.append(_chunk({}, "stop"))
    usage = {
        **_chunk({}, None),
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens},
    }
    out.append(usage)
    data = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in out]
    return [*data, b"data: [DONE]\n\n"]


def _response(status: str, ctype: str, body: bytes, *, close: bool = False) -> bytes:
    conn = "Connection: close\r\n" if close else ""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{conn}\r\n"
    ).encode() + body


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
HOLD_POLL_S = 0.01
NOT_FOUND = b'{"error":{"message":"not found","type":"invalid_request_error","code":"not_found"}}'


def _nodelay(transport: asyncio.BaseTransport) -> None:
    """No Nagle delay for small writes (asyncio sets it only for sockets made with IPPROTO_TCP)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Backend(asyncio.Protocol):
    """One connection: requests are answered in order; a stream holds the connection."""

    # Filled in by ``serve`` (class-level so the per-connection factory stays trivial).
    stream_chunks: list[bytes] = []
    interval_s: float = 0.002
    completion: bytes = _response("200 OK", "application/json", COMPLETION_BODY)
    broker: dict[bytes, bytes] = {}  # path -> answer, on the stand-in broker socket
    hold: Path | None = None  # while it exists, streams hold their last event back
    models: bytes = b""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.streaming = False
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        _nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.streaming:
            self._serve()

    def _serve(self) -> None:
        buf = self.buf
        while buf and not self.streaming and self.transport is not None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            start = end + 4
            if b"\r\ntransfer-encoding: chunked" in head:
                got = decode_chunked(buf, start)
                if got is None:
                    return
                body, after = got
            else:
                i = head.find(b"\r\ncontent-length:")
                length = 0
                if i >= 0:
                    eol = head.find(b"\r\n", i + 2)
                    length = int(head[i + 17 : eol if eol >= 0 else None])
                if len(buf) < start + length:
                    return
                body, after = bytes(buf[start : start + length]), start + length
            del buf[:after]
            self._answer(head, body)

    def _answer(self, head: bytes, body: bytes) -> None:
        transport = self.transport
        assert transport is not None
        close = b"\r\nconnection: close" in head
        line = head.split(b"\r\n", 1)[0]
        method, _, rest = line.partition(b" ")
        path = rest.rsplit(b" ", 1)[0]
        if method == b"post" and path == b"/v1/chat/completions":
            if b'"stream"' in body and json.loads(body).get("stream") is True:
                self._start_stream(close)
                return
            transport.write(self.completion)
        elif method == b"post" and path in self.broker:
            answer = self.broker[path]
            transport.write(_response("200 OK", "application/json", answer, close=close))
        elif method == b"get" and path in (b"/health", b"/health/"):
            transport.write(_response("200 OK", "application/json", b'{"status":"ok"}'))
        elif method == b"get" and path == b"/v1/models":
            transport.write(_response("200 OK", "application/json", self.models))
        else:
            transport.write(_response("404 Not Found", "application/json", NOT_FOUND))
        if close:
            transport.close()

    def _start_stream(self, close: bool) -> None:
        assert self.transport is not None
        self.streaming = True
        chunks = self.stream_chunks
        self.transport.write(STREAM_HEAD + chunks[0])
        self.loop.call_later(self.interval_s, self._next, 1, close)

    def _next(self, i: int, close: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        chunks = self.stream_chunks
        if i < len(chunks) - 1:
            transport.write(chunks[i])
            self.loop.call_later(self.interval_s, self._next, i + 1, close)
            return
        if self.hold is not None and self.hold.exists():
            self.loop.call_later(HOLD_POLL_S, self._next, i, close)
            return
        transport.write(chunks[i] + b"0\r\n\r\n")
        self.streaming = False
        if close:
            transport.close()
        elif self.buf:
            self._serve()


async def serve(args: argparse.Namespace) -> None:
    Backend.stream_chunks = [_chunked(e) for e in events(args.tokens)]
    Backend.interval_s = args.interval_ms / 1e3
    Backend.hold = Path(args.hold_file) if args.hold_file else None
    Backend.models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
    ).encode()
    if args.broker_answers:
        answers = json.loads(Path(args.broker_answers).read_text())
        Backend.broker = {k.encode(): json.dumps(v).encode() for k, v in answers.items()}
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    server = await loop.create_server(Backend, sock=sock, backlog=4096)
    servers = [server]
    if args.broker_socket:
        Path(args.broker_socket).unlink(missing_ok=True)
        servers.append(await loop.create_unix_server(Backend, path=args.broker_socket))
    port = sock.getsockname()[1]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        Path(tmp).write_text(f"{port}\n")
        os.replace(tmp, args.ready_file)
    await stop.wait()
    for s in servers:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", help="write the bound port here once listening")
    ap.add_argument("--tokens", type=int, default=16, help="content tokens per stream")
    ap.add_argument("--interval-ms", type=float, default=2.0, help="between stream events")
    ap.add_argument("--hold-file", help="while this file exists, streams hold their last event")
    ap.add_argument("--broker-socket", help="also stand in for the broker on this socket")
    ap.add_argument("--broker-answers", help="JSON file: broker path -> the JSON it answers")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
