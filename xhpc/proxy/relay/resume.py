"""Streams that outlive their engine: what a broken stream needs to go on elsewhere (pure
logic; decision 0012).

A stream the proxy may continue is sent to its first engine with ``return_token_ids: true``
(vLLM's OpenAI server then puts the prompt's token ids in the first chunk and each chunk's
generated token ids in it); the proxy notes them as the events reach the client and sets them
back to ``null`` there (unless the client asked for them), which is byte for byte what vLLM
writes without the flag. When the engine dies mid-stream, the continuation goes to
``/v1/completions`` of another replica with ``prompt`` = the prompt's token ids + the ids
already sent, and the output budget less what was sent: token ids, not text, because
re-tokenizing the text already sent changes the sequence at the seam (measured with vLLM CPU
and the tiny model: the text continuations of 47 of 175 greedy completions and 168 of 175
``continue_final_message`` chats differed from the undisturbed run; the token-id
continuations of all of them were equal). A chat is continued through the completions
endpoint too (chat has no token-id input) and its chunks are rewritten as chat chunks. Every
continuation chunk gets the client's first chunk's ``id``, ``object``, ``created`` and
``model``; ``usage`` counts the prompt once and the completion tokens of every leg.

Only what can be continued exactly is: ``refusal`` names what makes a request's output
depend on more than the prompt and the tokens so far (several choices, logprobs, tools,
structured output, stop strings, output penalties...), and a stream whose chunks carry
anything but content (reasoning, tool calls) or no token ids (an engine other than vLLM) is
not continued either.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from xhpc.proxy.relay.sse import DONE, Usage, data_of, split_events

HEADER = "X-Xhpc-Continue"  # "1" or "0": continue this request's stream or not
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions' budget when max_tokens is absent
TOKEN_IDS_FIELD = "return_token_ids"  # the field an engine that cannot give ids refuses

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})

# present (and not empty, false or null): the output is not a function of prompt + tokens
_UNSAFE = (
    "echo",
    "logprobs",
    "prompt_logprobs",
    "tools",
    "functions",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "stop",  # a stop string may straddle the seam; vLLM also holds text back for it
    "bad_words",
    "logits_processors",
    "suffix",
    "prompt_embeds",
    "truncate_prompt_tokens",
    "kv_transfer_params",
)
_NONZERO_UNSAFE = ("top_logprobs", "presence_penalty", "frequency_penalty")  # output-only state
_CHAT_ONLY = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "reasoning_effort",
        "include_reasoning",
        "return_prompt_text",
        "max_completion_tokens",
        "logprobs",  # a bool in chat, a count in completions
        "top_logprobs",
        "echo",
    }
)
_IDS = re.compile(rb'"token_ids":\[[0-9,\s]*\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[[0-9,\s]*\]')
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def wanted(default: bool, header: str | None) -> bool:
    """Whether this request's stream may be continued: the header's word, else the config's."""
    if header is not None:
        word = header.strip().lower()
        if word in _ON:
            return True
        if word in _OFF:
            return False
    return default


def _absent(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, str | list | dict) and not value)


def _single_prompt(prompt: Any) -> bool:
    """One prompt: a string or a token-id list, alone or as a batch of one."""
    if isinstance(prompt, str) or _token_list(prompt):
        return True
    return (
        isinstance(prompt, list)
        and len(prompt) == 1
        and (isinstance(prompt[0], str) or _token_list(prompt[0]))
    )


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def refusal(data: dict[str, Any], chat: bool) -> str | None:
    """Why the output of this request cannot be continued exactly (None: it can)."""
    for key in ("n", "best_of"):
        value = data.get(key)
        if value is not None and value != 1:
            return key
    for key in _UNSAFE:
        if not _absent(data.get(key)):
            return key
    for key in _NONZERO_UNSAFE:
        value = data.get(key)
        if not _absent(value) and value != 0:
            return key
    for key in ("tool_choice", "function_call"):
        value = data.get(key)
        if not _absent(value) and value != "none":
            return key
    response_format = data.get("response_format")
    if not _absent(response_format) and response_format != {"type": "text"}:
        return "response_format"
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = data.get(key)
        if value is not None and type(value) is not int:
            return key
    if not chat and not _single_prompt(data.get("prompt")):
        return "prompt"
    return None


class Resume:
    """One continuable stream: what reached the client, and the continuation's body.

    ``client_events`` takes the first engine's whole events on their way to the client,
    ``leg_events`` a continuation's (completions chunks, rewritten into the client's shape).
    """

    def __init__(self, data: dict[str, Any], chat: bool) -> None:
        self.data = data
        self.chat = chat
        self.keep_ids = data.get(TOKEN_IDS_FIELD) is True  # the client asked for them itself
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []  # the generated token ids whose chunks reached the client
        self.base = 0  # len(ids) when the current continuation began
        self.head: dict[str, Any] | None = None  # the client's first chunk's id, object...
        self.finished = False  # a finish_reason reached the client
        self.done = False  # data: [DONE] reached the client
        self.usage_sent = False  # the usage chunk (no choices) reached the client
        self.why: str | None = None  # why the stream can no longer be continued
        self.legs = 0  # continuations started

    def stop(self, why: str) -> None:
        if self.why is None:
            self.why = why

    @property
    def can_continue(self) -> bool:
        return self.why is None and self.prompt_ids is not None and not self.done

    @property
    def complete(self) -> bool:
        """The answer reached the client whole; at most its usage chunk and [DONE] are owed."""
        return self.done or (self.finished and self.why is None and self.head is not None)

    def usage(self) -> Usage | None:
        if self.prompt_ids is None:
            return None
        return Usage(len(self.prompt_ids), len(self.ids))

    # --- the first engine ---

    def first_body(self, served: str) -> bytes:
        """The request for the first engine: the client's, asking for token ids."""
        return json.dumps({**self.data, "model": served, TOKEN_IDS_FIELD: True}).encode()

    def client_events(self, data: bytes) -> bytes:
        """Note these whole events of the first engine; the bytes for the client."""
        for event in split_events(data):
            self._note_first(event)
        if not self.keep_ids and b"token_ids" in data:
            data = _IDS.sub(b'"token_ids":null', data)
            if b'"prompt_token_ids":[' in data:
                data = _PROMPT_IDS.sub(b'"prompt_token_ids":null', data)
        return data

    def _note_first(self, event: bytes) -> None:
        obj = self._parse(event)
        if obj is None:
            return
        if self.head is None:
            self.head = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        prompt_ids = obj.get("prompt_token_ids")  # chat: in the first chunk, top level
        if _token_list(prompt_ids):
            self.prompt_ids = prompt_ids
        self._note_choices(obj, first=True)

    def _parse(self, event: bytes) -> dict[str, Any] | None:
        """The event's JSON object (None for [DONE], comments and what is not continuable)."""
        payload = data_of(event)
        if payload is None:
            if event.strip() and not event.lstrip().startswith(b":"):
                self.stop("an event that is not one data line")
            return None
        if payload.strip() == DONE[6:]:
            self.done = True
            return None
        try:
            obj = _decode(payload)
        except msgspec.DecodeError:
            self.stop("an event that is not JSON")
            return None
        if not isinstance(obj, dict) or "error" in obj:
            self.stop("an error event")
            return None
        return obj

    def _note_choices(self, obj: dict[str, Any], *, first: bool) -> None:
        choices = obj.get("choices")
        if not isinstance(choices, list):
            self.stop("a chunk without choices")
            return
        if not choices and "usage" in obj:
            self.usage_sent = True
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.stop("several choices")
                continue
            if choice.get("logprobs") is not None:
                self.stop("logprobs")
            if first and _token_list(choice.get("prompt_token_ids")):
                self.prompt_ids = choice["prompt_token_ids"]
            tokens = choice.get("token_ids")
            if isinstance(tokens, list):
                self.ids.extend(tokens)
            elif not self._role_only(choice):
                self.stop("a chunk without token ids")
            if self.chat and first:
                delta = choice.get("delta")
                if not isinstance(delta, dict) or any(
                    k not in ("role", "content") and not _absent(v) for k, v in delta.items()
                ):
                    self.stop("a delta other than content")
            if choice.get("finish_reason") is not None:
                self.finished = True

    def _role_only(self, choice: dict[str, Any]) -> bool:
        """A chat stream's first chunk: the role, no content, no token."""
        delta = choice.get("delta")
        return (
            self.chat
            and isinstance(delta, dict)
            and _absent(delta.get("content"))
            and choice.get("finish_reason") is None
        )

    # --- a continuation ---

    def _budget(self) -> int | None:
        """The request's output budget (None: what the context leaves)."""
        data = self.data
        if self.chat:
            budget = data.get("max_completion_tokens")
            return data.get("max_tokens") if budget is None else budget
        budget = data.get("max_tokens")
        return COMPLETIONS_DEFAULT_MAX_TOKENS if budget is None else budget

    @property
    def needs_context_length(self) -> bool:
        """The budget is what the context leaves: the body needs the engine's max_model_len."""
        return self._budget() is None

    def continuation_body(self, served: str, context_len: int | None = None) -> bytes | None:
        """The request that goes on from the tokens sent, for another replica's
        ``/v1/completions`` (None: nothing can be asked for)."""
        if self.prompt_ids is None:
            return None
        sent = len(self.ids)
        budget = self._budget()
        if budget is None:
            if context_len is None:
                return None
            max_tokens = context_len  # the engine caps it at what the context has left
        else:
            max_tokens = budget - sent
            if max_tokens < 1:
                return None
        data = self.data
        body = {k: v for k, v in data.items() if k not in _CHAT_ONLY} if self.chat else dict(data)
        body.update(
            model=served,
            prompt=self.prompt_ids + self.ids,
            max_tokens=max_tokens,
            stream=True,
            return_token_ids=True,
        )
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens:
            body["min_tokens"] = max(0, min_tokens - sent)
        self.base = sent
        return json.dumps(body).encode()

    def leg_events(self, data: bytes) -> bytes:
        """A continuation's whole events, noted and rewritten as the client's stream."""
        out: list[bytes] = []
        for event in split_events(data):
            payload = data_of(event)
            if payload is not None and payload.strip() == DONE[6:]:
                self.done = True
                out.append(DONE + b"\n\n")
                continue
            obj = self._parse(event)
            if obj is None:  # a comment, or what the engine said instead of a chunk
                out.append(event)
                continue
            self._note_choices(obj, first=False)
            out.append(b"data: " + _encode(self._reshape(obj)) + b"\n\n")
        return b"".join(out)

    def _reshape(self, obj: dict[str, Any]) -> dict[str, Any]:
        head = self.head or {}
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self._usage(usage)
        if not self.chat:
            obj.update(id=head.get("id"), created=head.get("created"), model=head.get("model"))
            for choice in obj.get("choices") or ():
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
                if not self.keep_ids and "token_ids" in choice:
                    choice["token_ids"] = None
            return obj
        chunk: dict[str, Any] = dict(head)
        choices = []
        for choice in obj.get("choices") or ():
            finish = choice.get("finish_reason")
            out: dict[str, Any] = {
                "index": 0,
                "delta": {"content": choice.get("text") or ""},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish is not None:
                out["stop_reason"] = choice.get("stop_reason")
            out["token_ids"] = choice.get("token_ids") if self.keep_ids else None
            choices.append(out)
        chunk["choices"] = choices
        for key in ("usage", "system_fingerprint"):
            if key in obj:
                chunk[key] = obj[key]
        return chunk

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the client's: its prompt once, every leg's tokens."""
        prompt = len(self.prompt_ids or ())
        leg = usage.get("completion_tokens")
        completion = self.base + (leg if type(leg) is int else 0)
        out = dict(usage)
        out.update(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        if out.get("prompt_tokens_details") is not None:
            out["prompt_tokens_details"] = None  # the continuation's cache, not the client's
        return out

    def closing(self) -> bytes:
        """What completes a stream that was whole when its engine died: the usage chunk the
        client asked for, then ``data: [DONE]``."""
        if self.done:
            return b""
        out = b""
        options = self.data.get("stream_options")
        usage = self.usage()
        if (
            isinstance(options, dict)
            and options.get("include_usage")
            and not self.usage_sent
            and usage is not None
        ):
            total = usage.prompt_tokens + usage.completion_tokens
            numbers = {
                "prompt_tokens": usage.prompt_tokens,
                "total_tokens": total,
                "completion_tokens": usage.completion_tokens,
            }
            chunk = {**(self.head or {}), "choices": [], "usage": numbers}
            out = b"data: " + _encode(chunk) + b"\n\n"
        self.done = True
        return out + DONE + b"\n\n"
