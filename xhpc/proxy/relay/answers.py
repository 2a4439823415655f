"""What the gateway changes in an engine's answer on its way to the client (pure logic).

- **The model's public name.** An engine names the model as it was started: ``transformers
  serve`` by its filesystem path, vLLM by ``--served-model-name``. Clients asked for the public
  name (the deployment's), and a path says where the lab keeps its weights. ``Renamer`` rewrites
  the value of every ``"model"`` member that names the engine's model, in a whole body or in
  stream events; it exists only for routes whose two names differ, and it costs one substring
  search per piece when the name is absent. ``"model"`` followed by a colon cannot occur inside
  a JSON string (a quote there is escaped), so generated text is never touched.
- **The usage chunk the client did not ask for.** Every stream is sent with
  ``stream_options.include_usage`` so that its tokens count against its key's quota
  (``xhpc.proxy.relay.body``); when the client did not ask for it, ``UsageStrip`` takes the engine's
  usage-only chunk (``"choices": []`` and a ``usage`` object) out of the client's stream again.
  Asked for usage, vLLM also moves ``system_fingerprint`` from the terminal chunks (those with
  a ``finish_reason``) to the usage chunk; so terminal chunks, and what follows them, are held
  until the usage chunk and given their fingerprint back where vLLM writes it (last). With one
  choice nothing waits: the usage chunk follows the terminal chunk at once. Every event, and
  ``[DONE]``, reaches the client byte for byte as the engine would have written it unasked.
"""

from __future__ import annotations

import json
import re

import msgspec

from xhpc.proxy.relay.sse import DONE, data_of, split_events

DONE_PAYLOAD = DONE[6:]  # b"[DONE]"

USAGE_KEY = b'"usage"'
FINGERPRINT = b'"system_fingerprint"'
HOLD_MAX = 1 << 20  # held bytes beyond this are let go as they are
_TERMINAL = re.compile(rb'"finish_reason"\s*:\s*"')  # a finish_reason that is not null
_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_NULL = msgspec.Raw(b"null")


def _usage_only(event: bytes) -> bytes | None:
    """For a usage-only chunk: its ``system_fingerprint`` as raw JSON (b"" without one);
    None for any other event."""
    payload = data_of(event)
    if payload is None or USAGE_KEY not in payload:
        return None
    try:
        fields = _decode_fields(payload)
    except msgspec.DecodeError:
        return None
    choices, usage = fields.get("choices"), fields.get("usage")
    if choices is None or bytes(choices).replace(b" ", b"") != b"[]":
        return None
    if usage is None or not bytes(usage).lstrip().startswith(b"{"):
        return None
    fingerprint = fields.get("system_fingerprint")
    return b"" if fingerprint is None or fingerprint == _NULL else bytes(fingerprint)


def _stamped(event: bytes, fingerprint: bytes) -> bytes:
    """A held event as vLLM writes a terminal chunk unasked: ``system_fingerprint`` last."""
    if not fingerprint or FINGERPRINT in event or not _TERMINAL.search(event):
        return event
    body = event.rstrip(b"\r\n")
    if not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + fingerprint + b"}" + event[len(body) :]


class UsageStrip:
    """One stream's usage chunk taken out (see the module docstring): ``feed`` takes whole
    events and returns those the client gets now; ``flush`` lets go of what is held (the
    stream broke)."""

    __slots__ = ("_held", "_size")

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> bytes:
        if not self._held and USAGE_KEY not in data and not _TERMINAL.search(data):
            return data  # the usual event: nothing to hold, nothing to take out
        out: list[bytes] = []
        for event in split_events(data):
            fingerprint = _usage_only(event)
            if fingerprint is not None:
                out += [_stamped(e, fingerprint) for e in self._held]
                self._held, self._size = [], 0
            elif self._held or _TERMINAL.search(event):
                if data_of(event) == DONE_PAYLOAD:  # the end, without a usage chunk
                    out += self._held
                    out.append(event)
                    self._held, self._size = [], 0
                    continue
                self._held.append(event)
                self._size += len(event)
                if self._size > HOLD_MAX:
                    out.append(self.flush())
            else:
                out.append(event)
        return b"".join(out)

    def flush(self) -> bytes:
        held = b"".join(self._held)
        self._held, self._size = [], 0
        return held


_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"(?!abort"|error")')  # an answer's true end
UNFINISHED = ("abort", "error", None)  # finish reasons of an answer the engine did not finish
_FINISH_KEY = b'"finish_reason"'
_UNFINISHED = re.compile(rb'"finish_reason"\s*:\s*(?:null|"abort"|"error")')


class FinishWatch:
    """A stream that must end with its answer finished (a PD decode leg): vLLM ends a request
    it aborted (its engine stopping, its KV never arriving) with a usage chunk and ``[DONE]``
    but no finish reason, a 200 without the answer. ``feed`` takes whole events and returns
    them, without a ``[DONE]`` that no finished chunk (a ``finish_reason`` other than
    ``abort``/``error``) preceded; ``unfinished`` then says so, and the stream ends with an
    error event instead."""

    __slots__ = ("finished", "unfinished")

    def __init__(self) -> None:
        self.finished = False
        self.unfinished = False

    def feed(self, data: bytes) -> bytes:
        if self.finished:
            return data
        if _FINISHED.search(data):
            self.finished = True  # a terminal chunk comes before the [DONE] that follows it
            return data
        if DONE_PAYLOAD not in data:
            return data
        kept = [e for e in split_events(data) if data_of(e) != DONE_PAYLOAD]
        self.unfinished = len(kept) < len(split_events(data))
        return b"".join(kept)


def unfinished_answer(body: bytes) -> str | None:
    """Why a whole chat or completions answer is not a finished one (a choice without a
    finish reason, or aborted), or None; an answer that is not such JSON is left alone. Only an
    answer whose bytes may hold such a choice is parsed (the usual one is not)."""
    if _FINISH_KEY in body and not _UNFINISHED.search(body):
        return None
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return None
    if not isinstance(choices, list) or not choices:
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("finish_reason") in UNFINISHED:
            return f"the engine ended the answer unfinished ({choice.get('finish_reason')})"
    return None


class Renamer:
    """Rewrites ``"model": "<served>"`` to ``"model": "<public>"`` (spacing kept)."""

    __slots__ = ("_needles", "_pattern", "_public")

    def __init__(self, served: str, public: str) -> None:
        # The engine may write the name with or without \\u escapes (json.dumps, or pydantic).
        spellings = dict.fromkeys(
            (json.dumps(served).encode(), json.dumps(served, ensure_ascii=False).encode())
        )
        self._needles = tuple(spellings)
        names = b"|".join(re.escape(s) for s in spellings)
        self._pattern = re.compile(rb'("model"\s*:\s*)(?:' + names + rb")")
        self._public = json.dumps(public).encode()

    def __call__(self, data: bytes) -> bytes:
        if not any(needle in data for needle in self._needles):
            return data
        public = self._public
        return self._pattern.sub(lambda m: m.group(1) + public, data)


_RENAMERS: dict[tuple[str, str], Renamer] = {}


def renamer(served: str, public: str) -> Renamer | None:
    """The rewrite from the engine's name to the public one; None when they are the same."""
    if served == public:
        return None
    key = (served, public)
    found = _RENAMERS.get(key)
    if found is None:
        if len(_RENAMERS) >= 1024:
            _RENAMERS.clear()
        found = _RENAMERS[key] = Renamer(served, public)
    return found
