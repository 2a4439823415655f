"""What a request holds of its key's limits while it runs (pure logic; decision 0007).

- **A concurrency slot**, for a key with ``max_concurrent``: a request over the cap is refused
  (429 with Retry-After) before its body is read.
- **Its output budget, reserved against the key's token quota.** Usage is known only when an
  answer ends, so a quota checked at admission alone lets any number of parallel requests in.
  Each request of a key with a quota reserves its budget (``output_budget``) at admission, and
  is admitted only while the key's counted tokens plus every reservation in flight are under
  the quota; when its usage arrives the reservation is released and the real count added. So
  parallel requests overshoot a quota by at most one request (the one admitted with something
  left). An answer that ends without usage (the client left before the usage chunk, an engine
  that counts nothing) is charged its reservation.

Both hold for the whole gateway: with several workers, each publishes its holds and reads the
others' (``xhpc.proxy.tenants.shared_holds``; a worker that dies has its holds given back by the
supervisor). Between a quota check in one worker and its reservation another worker may
reserve too, so the overshoot is at most one request per worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_CHOICES = 128  # ``n`` beyond this is not multiplied further (engines refuse it anyway)


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def output_budget(bounds: list[Any], n: Any, default: int) -> int:
    """The most tokens a request may generate: the first of ``bounds`` that is a count (the
    values of its endpoint's ``budget_fields``: ``max_completion_tokens``, then ``max_tokens``),
    else ``default`` (the engine's own default is not known here), times ``n`` choices; an
    endpoint with no bound (embeddings, tokenize, rerank) generates none."""
    if not bounds:
        return 0
    budget = next((c for c in map(_count, bounds) if c is not None), default)
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


class SharedCounts(Protocol):
    """The other workers' holds (``xhpc.proxy.tenants.shared_holds.SharedHolds``)."""

    def others(self, key_id: str) -> tuple[int, int]: ...
    def admit(self, key_id: str, cap: int, in_flight: int, reserved: int) -> bool: ...
    def publish(self, key_id: str, in_flight: int, reserved: int) -> None: ...


@dataclass
class Holds:
    """Per key: requests in flight (keys with a cap only) and tokens reserved, in this worker;
    with ``shared``, published to the gateway's other workers and counted with theirs."""

    in_flight: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    shared: SharedCounts | None = None

    def enter(self, hold: Hold, cap: int) -> bool:
        """Take a slot for ``hold`` unless the key has ``cap`` requests in flight."""
        key = hold.key_id
        running = self.in_flight.get(key, 0)
        if self.shared is not None:
            if not self.shared.admit(key, cap, running, self.reserved.get(key, 0)):
                return False
        elif running >= cap:
            return False
        self.in_flight[key] = running + 1
        hold.slot = True
        return True

    def reserved_by_all(self, key_id: str) -> int:
        """Tokens reserved for the key by requests in flight, in every worker."""
        own = self.reserved.get(key_id, 0)
        return own + (self.shared.others(key_id)[1] if self.shared is not None else 0)

    def reserve(self, hold: Hold, tokens: int) -> None:
        if tokens <= 0:  # nothing generated (embeddings, tokenize, rerank): nothing held
            return
        self.reserved[hold.key_id] = self.reserved.get(hold.key_id, 0) + tokens
        hold.tokens += tokens
        self._publish(hold.key_id)

    def release(self, hold: Hold) -> None:
        """Give back whatever ``hold`` holds (once)."""
        key = hold.key_id
        changed = hold.slot or hold.tokens
        if hold.slot:
            hold.slot = False
            _drop(self.in_flight, key, 1)
        if hold.tokens:
            _drop(self.reserved, key, hold.tokens)
            hold.tokens = 0
        if changed:
            self._publish(key)

    def _publish(self, key: str) -> None:
        if self.shared is not None:
            self.shared.publish(key, self.in_flight.get(key, 0), self.reserved.get(key, 0))


def _drop(counts: dict[str, int], key: str, by: int) -> None:
    left = counts.get(key, 0) - by
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
