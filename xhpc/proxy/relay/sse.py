"""Server-sent events passed through byte-exact, one whole event at a time (pure logic).

``SseRelay.feed`` takes the engine's chunks as they arrive and returns the bytes to forward now:
everything up to the last complete event (an event ends with a blank line). Bytes are never
changed, reordered or delayed past the end of their event, so the client sees exactly what the
engine sent; holding back a partial event means that when a stream breaks, the client has only
whole events and the error event that follows parses. On the way it notes whether the stream
ended with ``data: [DONE]`` and keeps the last data event (the one that carries ``usage``).

``usage_of`` reads a response's ``usage`` object without parsing the whole body;
``split_events`` cuts whole events apart (for a stream the proxy rewrites, decision 0012).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import msgspec

MAX_PENDING = 1 << 20  # a partial event larger than this is forwarded as it is
DONE = b"data: [DONE]"
USAGE_WINDOW = 4096  # bytes read for a usage object
_DECODER = json.JSONDecoder()


def _end_of_last_event(data: bytes) -> int:
    """The index just past the last blank line in ``data`` (0 when it has none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


class SseRelay:
    """Aligns an event stream on event boundaries and watches its end."""

    __slots__ = ("done", "last_data", "pending")

    def __init__(self) -> None:
        self.pending = b""  # the start of an event whose blank line has not arrived
        self.done = False  # the last event so far was `data: [DONE]`
        self.last_data = b""  # the last data event other than [DONE]

    def feed(self, chunk: bytes) -> bytes:
        """The bytes that can go to the client now (possibly empty)."""
        data = self.pending + chunk if self.pending else chunk
        end = _end_of_last_event(data)
        if end == 0:
            if len(data) > MAX_PENDING:
                self.pending = b""
                return data
            self.pending = data
            return b""
        if end == len(data):
            self.pending = b""
            self._note(data)
            return data
        self.pending = data[end:]
        out = data[:end]
        self._note(out)
        return out

    def _note(self, events: bytes) -> None:
        """Walk back over these whole events to the last data event (comments do not count)."""
        if b"\r" in events:
            events = events.replace(b"\r\n", b"\n")
        text = events.rstrip(b"\n")
        end = len(text)
        first = True
        while end > 0:
            cut = text.rfind(b"\n\n", 0, end)
            event = text[cut + 2 if cut >= 0 else 0 : end].strip()
            end = max(cut, 0)
            if event == DONE or event == b"data:[DONE]":
                if first:
                    self.done = True
                    first = False
            elif event.startswith(b"data:") or b"\ndata:" in event:
                if first:
                    self.done = False
                self.last_data = event
                return

    def finish(self, done_marker: bool = True) -> bytes:
        """At the engine's end of stream: what is still owed to the client so that the stream
        ends well — a partial last event completed, then ``data: [DONE]`` if it was missing
        (for streams that end with one: ``done_marker``)."""
        rest = self.pending
        self.pending = b""
        if rest.strip():
            self._note(rest)
            if not rest.endswith(b"\n"):
                rest += b"\n\n"
            elif not rest.endswith(b"\n\n") and not rest.endswith(b"\n\r\n"):
                rest += b"\n"
        if not self.done and done_marker:
            rest += DONE + b"\n\n"
            self.done = True
        return rest


def split_events(data: bytes) -> list[bytes]:
    """``data`` (whole events, as ``SseRelay.feed`` returns them) cut into its events, each
    with its blank line; a last piece without one is returned as it is."""
    out: list[bytes] = []
    start, size = 0, len(data)
    while start < size:
        lf = data.find(b"\n\n", start)
        crlf = data.find(b"\n\r\n", start)
        if lf < 0 and crlf < 0:
            out.append(data[start:])
            break
        end = lf + 2 if crlf < 0 or 0 <= lf < crlf else crlf + 3
        out.append(data[start:end])
        start = end
    return out


def data_of(event: bytes) -> bytes | None:
    """The payload of an event that is one ``data:`` line (what engines send); None for any
    other event (comments, several lines, other fields)."""
    line = event.rstrip(b"\r\n")
    if not line.startswith(b"data:") or b"\n" in line:
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(b" ") else payload


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int


def usage_of(body: bytes) -> Usage | None:
    """The ``usage`` of an OpenAI response or stream event, found from the end of ``body``
    (it follows ``choices``, so the search never scans the generated text first)."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    start = body.find(b"{", at + 7)
    colon = body.find(b":", at + 7)
    if start < 0 or colon < 0 or body[colon + 1 : start].strip():
        return None  # "usage": null, or not an object
    end = body.find(b"}", start)
    if 0 < end < start + USAGE_WINDOW and body.find(b"{", start + 1, end) < 0:
        try:  # a flat object (the usual one): msgspec decodes just it, just these two fields
            flat = _decode_usage(body[start : end + 1])
        except msgspec.DecodeError:
            pass  # e.g. a "}" in a string, NaN: the stdlib's reading below
        else:
            if flat.prompt_tokens is not None:
                return _usage(flat.prompt_tokens, flat.completion_tokens)
    try:  # the object may nest (prompt_tokens_details); decode just it, not what follows
        usage, _ = _DECODER.raw_decode(
            body[start : start + USAGE_WINDOW].decode("utf-8", "replace")
        )
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))  # /v1/responses: input_
    if prompt is None and "completion_tokens" not in usage:
        prompt = usage.get("total_tokens")  # rerank counts its tokens so
    return _usage(prompt, usage.get("completion_tokens", usage.get("output_tokens", 0)))


def _usage(prompt: Any, completion: Any) -> Usage | None:
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


class _FlatUsage(msgspec.Struct):
    prompt_tokens: Any = None
    completion_tokens: Any = 0


_decode_usage = msgspec.json.Decoder(_FlatUsage).decode
