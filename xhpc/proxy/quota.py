"""What a request holds of its key's limits while it runs (pure logic; decision 0007).

- **A concurrency slot**, for a key with ``max_concurrent``: a request over the cap is refused
  (429 with Retry-After) before its body is read.
- **Its output budget, reserved against the key's token quota.** Usage is known only when an
  answer ends, so a quota checked at admission alone lets any number of parallel requests in.
  Each request of a key with a quota reserves its budget (``output_budget``) at admission, and
  is admitted only while the key's counted tokens plus every reservation in flight are under
  the quota; when its usage arrives the reservation is released and the real count added. So
  parallel requests overshoot a quota by at most one request (the one admitted with something
  left), per gateway worker: the holds live in each worker's memory (a shared file could not
  give back the holds of a worker that died). An answer that ends without usage (the client
  left before the usage chunk, an engine that counts nothing) is charged its reservation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_CHOICES = 128  # ``n`` beyond this is not multiplied further (engines refuse it anyway)


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def output_budget(
    path: str, max_tokens: Any, max_completion_tokens: Any, n: Any, default: int
) -> int:
    """The most tokens a request may generate: ``max_completion_tokens``, else ``max_tokens``,
    else ``default`` (the engine's own default is not known here), times ``n`` choices;
    embeddings generate none."""
    if path == EMBEDDINGS_PATH:
        return 0
    budget = _count(max_completion_tokens)
    if budget is None:
        budget = _count(max_tokens)
    if budget is None:
        budget = default
    choices = _count(n)
    if choices is not None and choices > 1:
        budget *= min(choices, MAX_CHOICES)
    return budget


@dataclass(slots=True)
class Hold:
    """One request's hold on its key: a concurrency slot, and tokens reserved."""

    key_id: str
    slot: bool = False
    tokens: int = 0


@dataclass
class Holds:
    """Per key: requests in flight (keys with a cap only) and tokens reserved, in this worker."""

    in_flight: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)

    def enter(self, hold: Hold, cap: int) -> bool:
        """Take a slot for ``hold`` unless the key has ``cap`` requests in flight."""
        running = self.in_flight.get(hold.key_id, 0)
        if running >= cap:
            return False
        self.in_flight[hold.key_id] = running + 1
        hold.slot = True
        return True

    def reserve(self, hold: Hold, tokens: int) -> None:
        self.reserved[hold.key_id] = self.reserved.get(hold.key_id, 0) + tokens
        hold.tokens += tokens

    def release(self, hold: Hold) -> None:
        """Give back whatever ``hold`` holds (once)."""
        key = hold.key_id
        if hold.slot:
            hold.slot = False
            _drop(self.in_flight, key, 1)
        if hold.tokens:
            _drop(self.reserved, key, hold.tokens)
            hold.tokens = 0


def _drop(counts: dict[str, int], key: str, by: int) -> None:
    left = counts.get(key, 0) - by
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
