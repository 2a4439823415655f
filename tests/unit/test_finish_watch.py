"""An answer the engine did not finish (``xhpc.proxy.relay.answers``: ``FinishWatch`` for streams,
``unfinished_answer`` for whole answers): what vLLM sends for a request it aborted."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from xhpc.proxy.relay.answers import FinishWatch, unfinished_answer


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return ev({"object": "chat.completion.chunk", "choices": [choice]})


USAGE = ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}})
DONE = b"data: [DONE]\n\n"


def fed(pieces: list[bytes]) -> tuple[bytes, FinishWatch]:
    watch = FinishWatch()
    return b"".join(watch.feed(p) for p in pieces), watch


def test_a_finished_stream_passes_byte_for_byte() -> None:
    pieces = [chunk("Hel"), chunk("lo", "length") + USAGE + DONE]
    out, watch = fed(pieces)
    assert out == b"".join(pieces) and not watch.unfinished


def test_an_aborted_stream_loses_its_done_and_says_so() -> None:
    for last in (None, "abort", "error"):
        pieces = [chunk(""), chunk("", last) + USAGE, DONE]
        out, watch = fed(pieces)
        assert out == chunk("") + chunk("", last) + USAGE
        assert watch.unfinished


def test_done_as_generated_text_is_not_the_end() -> None:
    pieces = [chunk("data: [DONE]"), chunk(" [DONE]", "stop"), DONE]
    out, watch = fed(pieces)
    assert out == b"".join(pieces) and not watch.unfinished


@given(st.lists(st.sampled_from(["stop", "length", "abort", None]), min_size=1, max_size=5))
def test_done_survives_exactly_when_a_true_finish_came_before_it(
    finishes: list[str | None],
) -> None:
    pieces = [chunk("x", f) for f in finishes] + [DONE]
    out, watch = fed(pieces)
    finished = any(f in ("stop", "length") for f in finishes)
    assert out.endswith(DONE) == finished == (not watch.unfinished)


def test_whole_answers() -> None:
    def answer(*finishes: str | None) -> bytes:
        choices = [{"index": i, "message": {"content": "x"}, "finish_reason": f}
                   for i, f in enumerate(finishes)]  # fmt: skip
        return json.dumps({"choices": choices}).encode()

    assert unfinished_answer(answer("stop")) is None
    assert unfinished_answer(answer("length", "tool_calls")) is None
    assert unfinished_answer(answer("abort")) == "the engine ended the answer unfinished (abort)"
    assert unfinished_answer(answer("stop", None)) is not None
    assert unfinished_answer(answer("error")) is not None
    for other in (b"not json", b"[1]", b'{"data": []}', b'{"choices": []}'):
        assert unfinished_answer(other) is None  # not a chat or completions answer: left alone


def test_whole_answers_with_any_spacing_and_a_choice_without_its_key() -> None:
    spaced = b'{"choices": [{"index": 0, "finish_reason" :  "abort"}]}'
    assert unfinished_answer(spaced) == "the engine ended the answer unfinished (abort)"
    assert unfinished_answer(b'{"choices":[{"finish_reason":null}]}') is not None
    assert unfinished_answer(b'{"choices":[{"index":0}]}') is not None  # no key: parsed
    assert unfinished_answer(b'{"choices":[{"text":"\\"finish_reason\\": null"}],') is None
