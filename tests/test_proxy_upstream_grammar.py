"""Properties of the proxy's own HTTP/1.1 client (xhpc.proxy.engines.upstream) against an engine
that writes any bytes at all, on a loopback socket: every call ends (an answer or an error) well
before its timeout, a chunk size or a framing header is taken exactly when a hand-written
reference of the grammar takes it, a cut answer is never taken for a whole one, and a
connection that saw a protocol error is never used again.

Each example runs its own event loop; a frozen loop fails the test by its time limit."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.proxy_fakes import scripted_engine
from xhpc.proxy.engines.http1 import AnswerParser, MalformedAnswer
from xhpc.proxy.engines.upstream import UpstreamSession
from xhpc.proxy.engines.upstream_api import (
    Timeouts,
    UpstreamAnswerTooLarge,
    UpstreamDropped,
    UpstreamError,
    UpstreamProtocolError,
)
from xhpc.proxy.engines.upstream_conn import MAX_BODY

pytestmark = [pytest.mark.timeout(120), pytest.mark.security]

FAST = settings(
    max_examples=80,
    deadline=None,  # loopback timings vary on a loaded machine; hangs are caught below
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TIMEOUT_S = 10.0
PROMPT_S = 2.0  # "well before its timeout"
TIMEOUT = Timeouts(total=TIMEOUT_S, connect=5)
HEADERS = {"Content-Type": "application/json"}
OK_BODY = b'{"ok": true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY)
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
HEX = b"0123456789abcdefABCDEF"

Outcome = bytes | BaseException


# --- the references: the grammar written out by hand ------------------------------------------


def chunk_size(line: bytes) -> int | None:
    """RFC 9112: ``1*HEXDIG [BWS ";" extension]`` (16 digits at most, no control characters
    but tab); the size, or None."""
    digits, semi, ext = line.partition(b";")
    if semi:
        digits = digits.rstrip(b" \t")
    if not 1 <= len(digits) <= 16 or any(c not in HEX for c in digits):
        return None
    if any((c < 0x20 and c != 0x09) or c == 0x7F for c in ext):
        return None
    return int(digits, 16)


def framing(version: str, fields: list[tuple[str, str]]) -> str | None:
    """How a head frames its body: "chunked", "length", "close", or None (refused)."""
    codings = [v.strip(" \t") for n, v in fields if n.lower() == "transfer-encoding"]
    lengths = [v.strip(" \t") for n, v in fields if n.lower() == "content-length"]
    if codings:
        ok = len(codings) == 1 and codings[0].lower() == "chunked"
        return "chunked" if ok and not lengths and version == "1.1" else None
    if lengths:
        ok = len(lengths) == 1 and lengths[0].isdigit() and len(lengths[0]) <= 18
        return "length" if ok and lengths[0].isascii() else None
    return "close"


# --- a client against a raw engine -------------------------------------------------------------


def run(scripts: list[list[bytes]]) -> tuple[list[tuple[Outcome, float]], int]:
    """POST once per script, the engine answering the n-th request it gets with the n-th
    script; each outcome (the body or the error) with its duration, and how many connections
    the engine saw."""

    async def main() -> tuple[list[tuple[Outcome, float]], int]:
        turns = iter(scripts)

        def answer(_: bytes) -> list[bytes]:
            return next(turns, [b"<close>"])

        async with scripted_engine(answer) as engine:
            session = UpstreamSession()
            outcomes: list[tuple[Outcome, float]] = []
            for _ in scripts:
                started = time.monotonic()
                try:
                    async with session.post(
                        engine.url, data=b"{}", headers=HEADERS, timeout=TIMEOUT
                    ) as r:
                        got: Outcome = await r.read()
                except Exception as err:
                    got = err
                outcomes.append((got, time.monotonic() - started))
            await session.close()
            return outcomes, len(engine.connections)

    return asyncio.run(main())


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` written in pieces, cut at ``cuts`` (each piece one write on the socket)."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def assert_refused_and_not_reused(outcomes: list[tuple[Outcome, float]], connections: int) -> None:
    (first, took), (second, _) = outcomes
    assert isinstance(first, UpstreamProtocolError), first
    assert took < PROMPT_S
    assert second == OK_BODY
    if not isinstance(first, bytes):
        assert connections == 2


# --- the properties ----------------------------------------------------------------------------

ext = st.sampled_from([b"", b";a=1", b" ; x", b";", b'\t;q="v"', b";\x00", b" "])
sized_lines = st.builds(
    lambda n, zeros, upper, tail: (b"0" * zeros + (b"%X" if upper else b"%x") % n) + tail,
    st.integers(0, 5000),
    st.integers(0, 17),
    st.booleans(),
    ext,
)
odd_lines = st.text(alphabet="0123456789abcdefxX+-_ ;=\t\r\n\x00", max_size=12).map(str.encode)
chunk_lines = st.one_of(sized_lines, odd_lines, st.binary(max_size=24)).filter(
    lambda line: b"\r\n" not in line
)


@FAST
@given(line=chunk_lines, cuts=st.lists(st.integers(0, 1 << 16), max_size=3))
@example(line=b"10000001", cuts=[])  # a chunk over the answer limit (found by hypothesis)
def test_a_chunk_size_is_taken_exactly_when_the_grammar_takes_it(
    line: bytes, cuts: list[int]
) -> None:
    size = chunk_size(line)
    event("taken" if size is not None else "refused")
    if size is not None and size > 1 << 16:
        # Not sent whole: only its start, which must not fail; a chunk larger than an answer
        # may be is refused as too large at once (the reader knows it cannot fit).
        too_large = size > MAX_BODY
        size = None
        answer = CHUNKED_HEAD + line + b"\r\n" + b"x" * 100
        outcomes, _ = run([[answer, b"<sleep 0.05>", b"<close>"]])
        want = UpstreamAnswerTooLarge if too_large else UpstreamDropped
        assert isinstance(outcomes[0][0], want), outcomes[0][0]
        return
    body = b"x" * (size or 0)
    tail = (body + b"\r\n0\r\n" if size else b"") + b"\r\n"
    answer = CHUNKED_HEAD + line + b"\r\n" + tail
    outcomes, connections = run([pieces(answer, cuts), [OK]])
    if size is None:
        assert_refused_and_not_reused(outcomes, connections)
    else:
        assert [got for got, _ in outcomes] == [body, OK_BODY]
        assert connections == 1


lengths = st.sampled_from(
    ["5", "05", " 5", "5 ", "+5", "-5", "5, 5", "0x5", "5_0", "", "\u0665", "5\t"]
)
codings = st.sampled_from(
    ["chunked", "Chunked", " chunked", "notchunked", "gzip", "gzip, chunked", "chunked, chunked"]
)
field = st.one_of(
    st.tuples(st.sampled_from(["Content-Length", "content-length"]), lengths),
    st.tuples(st.sampled_from(["Transfer-Encoding", "TRANSFER-ENCODING"]), codings),
    st.tuples(st.just("X-Other"), st.sampled_from(["1", "chunked", "5"])),
)


@FAST
@given(
    version=st.sampled_from(["1.1", "1.0"]),
    fields=st.lists(field, max_size=2),
)
def test_a_body_is_framed_exactly_as_the_grammar_frames_it(
    version: str, fields: list[tuple[str, str]]
) -> None:
    head = f"HTTP/{version} 200 OK\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields) + "\r\n"
    how = framing(version, fields)
    event(f"framing: {how}")
    body = b"5\r\nhello\r\n0\r\n\r\n" if how == "chunked" else b"hello"
    script = [head.encode("utf-8") + body]
    if how == "close":
        script.append(b"<close>")
    outcomes, connections = run([script, [OK]])
    if how is None:
        assert_refused_and_not_reused(outcomes, connections)
        return
    assert [got for got, _ in outcomes] == [b"hello", OK_BODY]  # every length above is 5
    assert connections == (1 if version == "1.1" and how != "close" else 2)


def whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def chunked(body: bytes) -> bytes:
    parts = [body[i : i + 7] for i in range(0, len(body), 7)]
    chunks = b"".join(b"%x;n=%d\r\n%s\r\n" % (len(p), i, p) for i, p in enumerate(parts))
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    return interim + CHUNKED_HEAD + chunks + b"0\r\nX-Trailer: 1\r\n\r\n"


FRAMINGS: dict[str, Callable[[bytes], bytes]] = {"whole": whole, "chunked": chunked}


@FAST
@given(
    frame=st.sampled_from(sorted(FRAMINGS)),
    body=st.binary(min_size=1, max_size=200),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=6),
)
def test_an_answer_in_any_pieces_is_read_whole(frame: str, body: bytes, cuts: list[int]) -> None:
    outcomes, connections = run([pieces(FRAMINGS[frame](body), cuts), [OK]])
    assert [got for got, _ in outcomes] == [body, OK_BODY]
    assert connections == 1


@settings(FAST, max_examples=25)
@given(frame=st.sampled_from(sorted(FRAMINGS)), body=st.binary(min_size=1, max_size=200))
def test_an_answer_cut_anywhere_is_never_taken_for_a_whole_one(frame: str, body: bytes) -> None:
    answer = FRAMINGS[frame](body)
    for cut in sorted({len(answer) * i // 7 for i in range(7)} | {len(answer) - 1}):
        outcomes, _ = run([[answer[:cut], b"<close>"] if cut else [b"<close>"]])
        got, took = outcomes[0]
        assert isinstance(got, UpstreamError), (cut, got)
        assert took < PROMPT_S


def mutate(data: bytes, at: int, byte: int, how: str) -> bytes:
    at %= len(data) + 1
    if how == "insert":
        return data[:at] + bytes([byte]) + data[at:]
    if how == "delete":
        return data[:at] + data[at + 1 :]
    return data[:at] + bytes([byte]) + data[at + 1 :]


@FAST
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.builds(
            mutate,
            st.sampled_from([OK, chunked(b"hello world, hello engines"), CHUNKED_HEAD]),
            st.integers(0, 1 << 16),
            st.integers(0, 255),
            st.sampled_from(["insert", "delete", "replace"]),
        ),
    ),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=3),
)
def test_any_bytes_then_a_close_end_the_call_at_once(data: bytes, cuts: list[int]) -> None:
    """Whatever an engine writes before it closes, the call ends at once: an answer, or one
    of the errors the forwarder handles; after an error, the next request goes on a new
    connection (after an answer it may go on the same one, which the engine may still read)."""
    outcomes, connections = run([[*pieces(data, cuts), b"<close>"], [OK]])
    (first, took), (second, _) = outcomes
    assert took < PROMPT_S
    assert isinstance(first, bytes | UpstreamError), repr(first)
    assert second == OK_BODY
    if not isinstance(first, bytes):
        assert connections == 2


class Recorder(AnswerParser):
    """The parser alone, noting what it hands on."""

    def __init__(self) -> None:
        super().__init__()
        self.body: list[bytes] = []
        self.done = False

    def _on_body(self, data: bytes) -> None:
        self.body.append(data)

    def _on_done(self) -> None:
        self.done = True


def verdict(parts: list[bytes]) -> tuple[object, ...]:
    parser = Recorder()
    try:
        for part in parts:
            parser.feed(part)
    except MalformedAnswer:
        return ("refused",)
    return parser.status, b"".join(parser.body), parser.done, parser.keep_alive


@settings(FAST, max_examples=300)
@given(
    data=st.builds(
        mutate,
        st.sampled_from([OK + OK, chunked(b"hello world, hello engines"), CHUNKED_HEAD]),
        st.integers(0, 1 << 16),
        st.sampled_from(b"\r\n0123456789abcdef;: -x"),
        st.sampled_from(["insert", "delete", "replace"]),
    ),
    cuts=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=8),
)
def test_the_parser_reads_the_same_answer_however_its_bytes_are_cut(
    data: bytes, cuts: list[int]
) -> None:
    """However the bytes arrive (where a line's end is searched from is kept between them),
    the verdict is the one on the bytes whole."""
    assert verdict(pieces(data, cuts)) == verdict([data])
