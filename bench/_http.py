"""A raw asyncio HTTP/1.1 load generator for bench/proxy.py (keep-alive, closed loop, callbacks).

Each ``LoadConn`` is one keep-alive connection that sends the same prepared request again as soon
as the previous answer is complete: no coroutine, future or parser object per request, only
``data_received`` callbacks, so that the client costs a few microseconds per request and is not
what a benchmark measures. It understands the answers the contenders give: ``Content-Length``
bodies, ``Transfer-Encoding: chunked`` bodies and bodies ended by closing the connection.

For streams (server-sent events) it notes when each event completes (the blank line that ends it
arrived) and keeps the whole body, so that the benchmark can check it against what the backend
sent: event count, the final ``data: [DONE]``, byte for byte.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from dataclasses import dataclass, field

DONE_EVENT = b"data: [DONE]"

_clock = time.perf_counter


def build_request(path: str, body: bytes, *, host: str, headers: dict[str, str]) -> bytes:
    """The bytes of one ``POST path`` HTTP/1.1 request with a JSON body."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        "Accept: */*",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def split_events(body: bytes) -> list[bytes]:
    """The events of an SSE body, each without its terminating blank line (LF or CRLF)."""
    text = body.replace(b"\r\n", b"\n")
    parts = text.split(b"\n\n")
    return [p for p in parts if p.strip()]


def decode_chunked(buf: bytes | bytearray, start: int) -> tuple[bytes, int] | None:
    """A whole chunked body from ``buf[start:]``: (body, index after it), or None if partial."""
    out = bytearray()
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                return None
            return bytes(out), end + 4
        if len(buf) < eol + 2 + size + 2:
            return None
        out += buf[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


@dataclass(slots=True)
class Stream:
    """One streamed answer as the client saw it."""

    sent: float
    status: int = 0
    event_times: list[float] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False

    @property
    def ttft(self) -> float | None:
        return self.event_times[0] - self.sent if self.event_times else None

    def gaps(self) -> list[float]:
        t = self.event_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(slots=True)
class Job:
    """What a set of connections does, and what they record.

    Non-streaming: requests go on for ``warm_s + dur_s`` from when the connections are open;
    answers completed in the last ``dur_s`` (``[window_start, stop_at]``) are recorded (latency)
    and counted; or, with ``per_conn``, each connection sends that many and all are recorded.
    Streaming: each connection runs ``per_conn`` streams one after another; all are recorded.
    """

    request: bytes
    stream: bool = False
    warm_s: float = 0.0
    dur_s: float = 0.0
    window_start: float = 0.0
    stop_at: float = float("inf")
    per_conn: int = 0
    latencies: list[float] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    sample_body: bytes | None = None
    error_notes: list[str] = field(default_factory=list)

    def note_error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_notes) < 5:
            self.error_notes.append(text)


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_TRAILER, _UNTIL_CLOSE = range(6)


class LoadConn(asyncio.Protocol):
    """One keep-alive connection running a closed loop of ``job.request``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.job: Job | None = None
        self.finished: asyncio.Future[None] | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.need = 0
        self.status = 0
        self.keep_alive = True
        self.sent = 0.0
        self.left = 0
        self.stream: Stream | None = None
        self.body = bytearray()
        self.closed = False

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        job = self.job
        if job is None or self.finished is None or self.finished.done():
            return
        if self.state == _UNTIL_CLOSE:
            self._complete(_clock())
            if self.finished.done():
                return
        job.note_error(f"connection lost mid-answer: {exc!r}")
        self._finish()

    def data_received(self, data: bytes) -> None:
        now = _clock()
        buf = self.buf
        buf += data
        while self.job is not None and not (self.finished is None or self.finished.done()):
            state = self.state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head(bytes(buf[:end]))
                del buf[: end + 4]
                if self.state == _LENGTH and self.need == 0:
                    self._complete(now)
            elif state == _LENGTH:
                if len(buf) < self.need:
                    return
                self._body(bytes(buf[: self.need]), now)
                del buf[: self.need]
                self._complete(now)
            elif state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return
                size = int(bytes(buf[:eol]).split(b";", 1)[0], 16)
                del buf[: eol + 2]
                if size == 0:
                    self.state = _CHUNK_TRAILER
                else:
                    self.need = size
                    self.state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                if len(buf) < self.need + 2:
                    return
                self._body(bytes(buf[: self.need]), now)
                del buf[: self.need + 2]
                self.state = _CHUNK_SIZE
            elif state == _CHUNK_TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                if end == 0:
                    del buf[:2]
                    self._complete(now)
                else:  # a trailer field; skip it
                    del buf[: end + 2]
            else:  # _UNTIL_CLOSE
                if buf:
                    self._body(bytes(buf), now)
                    buf.clear()
                return

    # --- the loop ----------------------------------------------------------------------------
    def start(self, job: Job) -> asyncio.Future[None]:
        """Run ``job`` on this connection; the future is done when it has nothing left to do."""
        self.job = job
        self.finished = asyncio.get_running_loop().create_future()
        self.left = job.per_conn
        if self.closed or self.transport is None:
            job.note_error("connection closed before the job started")
            self._finish()
        elif (job.stream or job.per_conn) and self.left <= 0:
            self._finish()
        else:
            self._send()
        return self.finished

    def _send(self) -> None:
        job = self.job
        assert job is not None and self.transport is not None
        self.state = _HEAD
        self.body = bytearray()
        self.sent = _clock()
        if job.stream:
            self.stream = Stream(self.sent)
        self.transport.write(job.request)

    def _head(self, head: bytes) -> None:
        self.status = int(head[9:12])
        lower = head.lower()
        self.keep_alive = b"\r\nconnection: close" not in lower
        if self.stream is not None:
            self.stream.status = self.status
        if b"\r\ntransfer-encoding: chunked" in lower:
            self.state = _CHUNK_SIZE
            return
        i = lower.find(b"\r\ncontent-length:")
        if i >= 0:
            eol = lower.find(b"\r\n", i + 2)
            self.need = int(lower[i + 17 : eol if eol >= 0 else None])
            self.state = _LENGTH
        else:
            self.state = _UNTIL_CLOSE
            self.keep_alive = False

    def _body(self, data: bytes, now: float) -> None:
        stream = self.stream
        if stream is None:
            self.body += data
            return
        stream.body += data
        # An event is complete when its blank line has arrived; count the new blank lines.
        body = stream.body
        old = len(body) - len(data)  # count the blank lines that end in the new bytes
        seen = body.count(b"\n\n", max(0, old - 1)) + body.count(b"\n\r\n", max(0, old - 2))
        if seen:
            stream.event_times.extend([now] * seen)

    def _complete(self, now: float) -> None:
        job = self.job
        assert job is not None
        job.statuses[self.status] = job.statuses.get(self.status, 0) + 1
        if self.status != 200:
            job.note_error(f"HTTP {self.status}: {bytes(self.body[:200])!r}")
        if job.stream:
            stream = self.stream
            assert stream is not None
            stream.complete = True
            job.streams.append(stream)
            job.completed += 1
            self.stream = None
            self.left -= 1
            more = self.left > 0
        else:
            counted = job.per_conn > 0
            if counted or job.window_start <= now <= job.stop_at:
                job.latencies.append(now - self.sent)
                job.completed += 1
                if job.sample_body is None and self.status == 200:
                    job.sample_body = bytes(self.body)
            if counted:
                self.left -= 1
                more = self.left > 0
            else:
                more = now < job.stop_at
        if not self.keep_alive:
            if more:
                job.note_error("the server closed the keep-alive connection")
            self._finish()
            return
        if more:
            self._send()
        else:
            self._finish()

    def _finish(self) -> None:
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    def abort(self, why: str) -> None:
        """Give up on the answer in flight (a hung contender): counted as an error."""
        job = self.job
        if job is not None and self.finished is not None and not self.finished.done():
            job.note_error(why)
            self._finish()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_conns(host: str, port: int, n: int) -> list[LoadConn]:
    loop = asyncio.get_running_loop()
    conns: list[LoadConn] = []
    for _ in range(n):
        _, proto = await loop.create_connection(LoadConn, host, port)
        conns.append(proto)
    return conns


async def run_job(
    host: str, port: int, conns: int, job: Job, *, timeout_s: float, prime: bytes | None = None
) -> Job:
    """Run ``job`` on ``conns`` fresh keep-alive connections (opened before the clock starts).

    With ``prime``, each connection first sends that request once, unrecorded, so the job starts
    on warm connections (as a client's keep-alive pool is); a failed one counts as an error."""
    pool = await open_conns(host, port, conns)
    if prime is not None:
        warm = Job(prime, per_conn=1)
        await asyncio.wait([c.start(warm) for c in pool], timeout=timeout_s)
        job.errors += warm.errors
        job.error_notes += warm.error_notes
    if not job.stream and not job.per_conn:
        job.window_start = _clock() + job.warm_s
        job.stop_at = job.window_start + job.dur_s
    try:
        futures = [c.start(job) for c in pool]
        _, pending = await asyncio.wait(futures, timeout=timeout_s)
        if pending:
            for c in pool:
                c.abort(f"no answer within {timeout_s:.0f}s")
            await asyncio.wait(pending, timeout=1.0)
    finally:
        for c in pool:
            c.close()
    return job


async def get(host: str, port: int, path: str, *, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One ``GET`` on a fresh connection (readiness checks): (status, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(-1), timeout_s)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        decoded = decode_chunked(body, 0)
        body = decoded[0] if decoded else body
    return int(head[9:12]), body


def now() -> float:
    return _clock()
