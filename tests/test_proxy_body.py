"""The request body, parsed once: the same verdicts and the same upstream JSON as decoding it with
the stdlib and re-encoding it with the model renamed (what the proxy did before), without
re-encoding the prompt when the body is strict JSON."""

from __future__ import annotations

import json
import random
import string
from typing import Any

import pytest

from xhpc.proxy.errors import ProxyHTTPError
from xhpc.proxy.forward import RequestBody


def reference(raw: bytes, served: str) -> tuple[Any, ...]:
    """json.loads, checks, the model renamed: the outcome the proxy must keep."""
    try:
        body = json.loads(raw)
    except ValueError as err:
        return ("invalid_json", f"request body is not valid JSON: {err}")
    if not isinstance(body, dict):
        return ("invalid_json", "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return ("missing_model",)
    stream = body.get("stream") is True
    body["model"] = served
    return ("ok", model, stream, body)


def outcome(raw: bytes, served: str) -> tuple[Any, ...]:
    try:
        req = RequestBody(raw)
    except ProxyHTTPError as err:
        assert err.status == 400
        return (err.code,) if err.code == "missing_model" else (err.code, err.message)
    return ("ok", req.model, req.stream, json.loads(req.upstream(served)))


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN


CASES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"messages": [], "model": "m", "stream": true}',
    b'{"model": "m", "stream": 1}',
    b'{"model": "m", "stream": false, "stream": true}',
    b'{"model": "n", "model": "m"}',
    b'{"metadata": {"model": "x"}, "model": "m"}',
    b'{"mod\\u0065l": "m", "x": {"model": "y"}}',
    b'{"model": "\\u006d\\"q"}',
    b' \n{ "model"\n:\n"m" } ',
    b'{"model": "m", "content": "the \\"model\\": \\"x\\""}',
    '{"model": "m", "content": "ünïcödé 你好"}'.encode(),
    b'{"model": "m", "bad": "\xc3\x28"}',  # invalid UTF-8: the stdlib refuses it
    b'{"model": "m", "surrogate": "\xed\xa0\x80"}',  # the stdlib takes it (surrogatepass)
    b'{"model": "m", "lone": "\\ud800"}',
    b'{"model": "m", "x": NaN, "y": -Infinity}',
    b'{"model": "m", "big": 1e400, "int": 123456789012345678901234567890}',
    b'\xef\xbb\xbf{"model": "m"}',
    '{"model": "m"}'.encode("utf-16"),
    b'{"model": 1e400}',
    b'{"model": ""}',
    b'{"model": null}',
    b"{}",
    b"[]",
    b'"m"',
    b"",
    b"{",
    b'{"model": "m",}',
    b'{"model": "m"} x',
]


@pytest.mark.parametrize("raw", CASES)
@pytest.mark.parametrize("served", ["/models/served", "m", 'a"b é'])
def test_same_outcome_as_decoding_and_re_encoding(raw: bytes, served: str) -> None:
    assert same(outcome(raw, served), reference(raw, served))


def test_strict_body_keeps_the_prompt_bytes_and_replaces_only_the_model() -> None:
    raw = '{"messages": [{"role": "user", "content": "héllo \\u00e9"}], "model": "m"}'.encode()
    sent = RequestBody(raw).upstream("/models/m")
    kept = '[{"role": "user", "content": "héllo \\u00e9"}]'.encode()
    assert sent == b'{"messages":' + kept + b',"model":"/models/m"}'
    assert RequestBody(raw).upstream("m") is raw  # same name: the client's bytes as they are


def test_every_retry_gets_its_own_served_name() -> None:
    req = RequestBody(b'{"model": "m", "n": 1}')
    assert json.loads(req.upstream("a"))["model"] == "a"
    assert json.loads(req.upstream("b"))["model"] == "b"
    assert req.upstream("m") == b'{"model": "m", "n": 1}'


def test_data_is_the_decoded_object() -> None:
    req = RequestBody(b'{"model": "m", "user": "u", "x": 1e400}')
    assert req.data == {"model": "m", "user": "u", "x": float("inf")}


def test_random_bodies() -> None:
    rnd = random.Random(7)
    alphabet = string.ascii_letters + 'model"\\ :{}[],é你\n\t'

    def text() -> str:
        return "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 8)))

    def value(depth: int = 0) -> Any:
        r = rnd.random()
        if depth > 3 or r < 0.3:
            return text()
        if r < 0.4:
            return rnd.choice([True, False, None, 1.5, -3, float("nan")])
        if r < 0.7:
            keys = ["model", "stream", "role", text()]
            return {rnd.choice(keys): value(depth + 1) for _ in range(rnd.randint(0, 3))}
        return [value(depth + 1) for _ in range(rnd.randint(0, 3))]

    for _ in range(3000):
        items = [(rnd.choice(["messages", "user", "stream", text()]), value()) for _ in range(3)]
        model = rnd.choice([text(), "", None, 3, "m"])
        if rnd.random() < 0.95:
            items.insert(rnd.randint(0, len(items)), ("model", model))
        seps = rnd.choice([(",", ":"), (", ", ": "), (" ,\n", " :\t")])
        raw = json.dumps(dict(items), ensure_ascii=rnd.random() < 0.5, separators=seps).encode()
        if rnd.random() < 0.1:
            cut = rnd.randrange(len(raw))
            raw = raw[:cut] + raw[cut + 1 :]
        served = rnd.choice(["x", '/models/a"b', "é", model if isinstance(model, str) else "q"])
        assert same(outcome(raw, served), reference(raw, served)), raw
