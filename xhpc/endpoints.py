"""The engine endpoints the gateway forwards, and what it needs to know of each (pure data).

Every one is a ``POST`` whose JSON body names its ``model``, so each goes through the same
admission (the caller's key, the model's access, the key's concurrency and token quota),
routing, retries and usage accounting. They differ in:

- **what they generate**: the body fields that bound the output (reserved against a key's
  token quota; ``()``: nothing is generated, e.g. embeddings, tokenize, rerank);
- **their streams**: chat and completions streams end with ``data: [DONE]`` and carry a usage
  chunk when ``stream_options.include_usage`` asks for it (the gateway asks, so that every
  stream is counted); a ``/v1/responses`` stream is typed events (``event:`` and ``data:``
  lines) whose last, ``response.completed``, holds the usage, and has no ``[DONE]``;
- **the two-phase route**: only chat and completions are served prefill/decode disaggregated.

vLLM serves them all (rerank and score on a cross-encoder model, ``--runner pooling``); an engine
that lacks one answers 404, which the gateway gives the client as an OpenAI-shaped 404 that
names the engine (docs/members.md, docs/decisions/0033).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    body_limit: int  # the default limit on its request bodies (`[proxy.body_limits]`)
    budget_fields: tuple[str, ...] = ()  # the first one present bounds the output
    usage_chunk: bool = False  # its streams carry a usage chunk when asked (stream_options)
    done_marker: bool = False  # its streams end with `data: [DONE]`
    two_phase: bool = False  # served by the prefill/decode route for a PD model


CHAT = Endpoint(
    "/v1/chat/completions",
    4 * _MIB,
    ("max_completion_tokens", "max_tokens"),
    usage_chunk=True,
    done_marker=True,
    two_phase=True,
)
COMPLETIONS = replace(CHAT, path="/v1/completions")
EMBEDDINGS = Endpoint("/v1/embeddings", 16 * _MIB)
RESPONSES = Endpoint("/v1/responses", 4 * _MIB, ("max_output_tokens",))

ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        CHAT,
        COMPLETIONS,
        EMBEDDINGS,
        RESPONSES,
        Endpoint("/tokenize", 4 * _MIB),
        Endpoint("/detokenize", 4 * _MIB),
        Endpoint("/v1/rerank", 16 * _MIB),
        Endpoint("/rerank", 16 * _MIB),
        Endpoint("/v2/rerank", 16 * _MIB),
        Endpoint("/v1/score", 16 * _MIB),
        Endpoint("/score", 16 * _MIB),
    )
}
