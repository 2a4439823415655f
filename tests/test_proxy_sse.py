"""Unit tests for the event-aligned SSE relay and the ``usage`` reader (pure logic)."""

from __future__ import annotations

import json
import random

import pytest

from xhpc.proxy.relay.sse import SseRelay, Usage, usage_of

EVENTS = [
    b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"lo \xe2\x9c\x93"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)


def relay_all(chunks: list[bytes]) -> tuple[list[bytes], SseRelay]:
    relay = SseRelay()
    out = [relay.feed(c) for c in chunks]
    out.append(relay.finish())
    return out, relay


def test_whole_events_pass_at_once_and_unchanged() -> None:
    out, relay = relay_all(EVENTS)
    assert out[:-1] == EVENTS  # each event leaves as soon as it arrives
    assert out[-1] == b""  # nothing owed: the engine sent [DONE]
    assert relay.done
    assert usage_of(relay.last_data) == Usage(7, 2)


@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_gives_the_same_bytes_cut_on_event_boundaries(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 30)))
    chunks = [STREAM[i:j] for i, j in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
    out, relay = relay_all(chunks)
    assert b"".join(out) == STREAM
    sent = b""
    for piece in out:
        sent += piece
        assert sent == b"" or sent.endswith(b"\n\n")  # the client only ever has whole events
    assert relay.done
    assert usage_of(relay.last_data) == Usage(7, 2)


def test_crlf_boundaries_are_events_too() -> None:
    stream = STREAM.replace(b"\n", b"\r\n")
    out, relay = relay_all([stream[:10], stream[10:]])
    assert b"".join(out) == stream
    assert out[0] == b""
    assert relay.done


def test_missing_done_is_added_at_the_end() -> None:
    out, relay = relay_all(EVENTS[:3])
    assert b"".join(out) == b"".join(EVENTS[:3]) + b"data: [DONE]\n\n"
    assert usage_of(relay.last_data) == Usage(7, 2)


def test_unfinished_last_event_is_completed_then_done() -> None:
    _, relay = relay_all([EVENTS[0], b'data: {"x": 1}'])
    relay = SseRelay()
    assert relay.feed(EVENTS[0]) == EVENTS[0]
    assert relay.feed(b'data: {"x": 1}') == b""
    assert relay.finish() == b'data: {"x": 1}\n\ndata: [DONE]\n\n'
    relay = SseRelay()
    relay.feed(b"data: [DONE]\n")  # a DONE without its blank line: completed, not repeated
    assert relay.finish() == b"data: [DONE]\n\n"


def test_an_event_after_done_means_not_done() -> None:
    relay = SseRelay()
    relay.feed(b"data: [DONE]\n\n")
    relay.feed(b'data: {"late": true}\n\n')
    assert not relay.done
    assert relay.finish().endswith(b"data: [DONE]\n\n")


def test_comments_do_not_change_done() -> None:
    relay = SseRelay()
    relay.feed(EVENTS[3] + b": keep-alive\n\n")
    assert relay.done


def test_huge_partial_event_is_not_held_forever() -> None:
    relay = SseRelay()
    big = b"data: " + b"x" * (1 << 20) + b"y"
    assert relay.feed(big[:100]) == b""
    assert relay.feed(big[100:]) == big


def test_usage_of_non_streamed_bodies() -> None:
    body = {
        "id": "x",
        "choices": [{"message": {"content": 'a "usage": {"prompt_tokens": 99} trap'}}],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 4,
            "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "kv_transfer_params": None,
    }
    assert usage_of(json.dumps(body).encode()) == Usage(11, 4)
    embeddings = {"data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    assert usage_of(json.dumps(embeddings).encode()) == Usage(5, 0)


@pytest.mark.parametrize(
    "body",
    [b"", b'{"usage": null}', b'{"usage": 3}', b'{"usage": {"prompt_tokens": "x"}}', b'"usage"{'],
)
def test_usage_of_without_usable_usage(body: bytes) -> None:
    assert usage_of(body) is None
