"""A request's JSON body, parsed once (pure logic): its model, whether it streams, the fields
the gateway reads (output budgets, stream options), and the body to send to an engine.

The gateway changes two things in what it sends: ``model`` (the engine's own name for the
model) and, for a stream whose client did not ask for its usage, ``stream_options`` (the usage
chunk is asked for, so that every stream is counted; ``xhpc.proxy.relay.answers`` takes it out of
the client's stream again).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from xhpc.proxy.errors import bad_request

_msgspec_decode = msgspec.json.decode


def _decode_json(raw: bytes) -> Any:
    """``raw`` decoded: msgspec's fast decoder, else the stdlib's verdict (it also takes NaN,
    ``1e400``, a BOM, UTF-16, lone surrogates; and its error message is the one clients see)."""
    try:
        return _msgspec_decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def parse_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """The request's JSON object and its ``model``; 400 when either is missing or malformed."""
    try:
        body = _decode_json(raw)
    except ValueError as err:
        raise bad_request(f"request body is not valid JSON: {err}", "invalid_json") from err
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return body, _model_of(body.get("model"))


def _model_of(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise bad_request(
            "you must provide a model parameter (a non-empty string)", "missing_model"
        )
    return model


_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode_fields = msgspec.json.Encoder().encode
_TRUE = msgspec.Raw(b"true")


def _fields(raw: bytes) -> dict[str, msgspec.Raw] | None:
    """The top-level members of a JSON object, their values as raw JSON (validated, not
    decoded); None unless ``raw`` is a strict JSON object that the stdlib would take too."""
    try:
        fields = _decode_fields(raw)
    except msgspec.DecodeError:  # not an object, or not strict JSON (NaN, a BOM, UTF-16...)
        return None
    if not raw.isascii():  # the skipped strings' UTF-8 is not checked; the stdlib's decoding:
        try:
            raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
    return fields


class RequestBody:
    """A request's JSON body, parsed once: its ``model``, whether it asks for a ``stream``, the
    decoded object when a step needs it (``data``), and the body to send upstream.

    Strict JSON (nearly every client's) is split into its top-level members without decoding
    their values; ``upstream`` then replaces only the model's value, so that the prompt is
    neither decoded nor re-encoded. Other bodies the stdlib takes are decoded and re-encoded.
    """

    __slots__ = ("_data", "_fields", "_model_json", "model", "raw", "stream")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._data: dict[str, Any] | None = None
        fields = self._fields = _fields(raw)
        if fields is None:
            self._data, self.model = parse_body(raw)
            self.stream = self._data.get("stream") is True
        else:
            model = self._model_json = fields.get("model")
            self.model = _model_of(None if model is None else _decode_json(bytes(model)))
            self.stream = fields.get("stream") == _TRUE

    @property
    def data(self) -> dict[str, Any]:
        """The decoded object (for affinity keys and the two-phase route)."""
        if self._data is None:
            self._data = _decode_json(self.raw)
        return self._data

    def field(self, name: str) -> Any:
        """One top-level member, decoded (None when absent)."""
        fields = self._fields
        if fields is None:
            return self.data.get(name)
        raw = fields.get(name)
        return None if raw is None else _decode_json(bytes(raw))

    def usage_options(self) -> dict[str, Any] | None:
        """For a stream whose client did not ask for its usage: the ``stream_options`` that ask
        the engine for it (the client's own, with ``include_usage`` on and per-chunk usage
        off, so that only the one usage chunk is added); None otherwise."""
        if not self.stream:
            return None
        options = self.field("stream_options")
        if not isinstance(options, dict):
            return {"include_usage": True}
        if _truthy(options.get("include_usage")):
            return None  # asked for: the client gets it
        out = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        out["include_usage"] = True
        return out

    def upstream(self, served: str, options: dict[str, Any] | None = None) -> bytes:
        """The body with ``model`` = ``served`` (the engine's name for the model), and with
        ``stream_options`` = ``options`` if given (``usage_options``)."""
        fields = self._fields
        if fields is None:
            data = self.data
            data["model"] = served
            if options is not None:  # a copy: the client's own options stay in ``data``
                data = {**data, "stream_options": options}
            return json.dumps(data).encode()
        value = msgspec.Raw(_json_string(served))
        if options is not None:
            fields["stream_options"] = msgspec.Raw(_encode_fields(options))
        elif value == self._model_json:
            return self.raw  # the engine's name is the client's, written the same way
        fields["model"] = value
        return _encode_fields(fields)


# What pydantic (vLLM's request models) reads as true in a boolean field.
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _truthy(value: Any) -> bool:
    if value is True:
        return True
    if type(value) is int or type(value) is float:
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE_WORDS


_JSON_STRINGS: dict[str, bytes] = {}


def _json_string(text: str) -> bytes:
    """``text`` as a JSON string literal, as ``json.dumps`` writes it (cached: served names)."""
    found = _JSON_STRINGS.get(text)
    if found is None:
        if len(_JSON_STRINGS) >= 1024:
            _JSON_STRINGS.clear()
        found = _JSON_STRINGS[text] = json.dumps(text).encode()
    return found
