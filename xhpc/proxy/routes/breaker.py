"""Circuit breakers per replica, and the retry budget (pure logic; the clock is passed in).

A replica's breaker is CLOSED while it answers. After ``failures`` consecutive failures
(connect errors, timeouts, 5xx, broken streams) it OPENs: the router skips it. Once
``cooldown_s`` has passed, the next pick takes it as the single HALF_OPEN probe; the probe's
success CLOSEs it, its failure OPENs it for another cool-down. A probe that ends without a
verdict (the client left) lets the next request probe instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}


class _Breaker:
    __slots__ = ("failures", "opened_at", "state")

    def __init__(self) -> None:
        self.failures = 0
        self.state = BreakerState.CLOSED
        self.opened_at = 0.0


class Breakers:
    """The breakers of all replicas. Replicas that never failed cost nothing (no entry)."""

    def __init__(self, failures: int = 5, cooldown_s: float = 10.0) -> None:
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self._by_replica: dict[str, _Breaker] = {}
        self.ejections: dict[str, int] = {}  # times each replica was opened

    @property
    def any_tripped(self) -> bool:
        """Whether some breaker is not CLOSED (the router's fast path checks this)."""
        if not self._by_replica:  # the usual case: no replica failed lately
            return False
        return any(b.state is not BreakerState.CLOSED for b in self._by_replica.values())

    def state(self, replica_id: str) -> BreakerState:
        b = self._by_replica.get(replica_id)
        return BreakerState.CLOSED if b is None else b.state

    def states(self) -> dict[str, BreakerState]:
        return {rid: b.state for rid, b in self._by_replica.items()}

    def available(self, replica_id: str, now: float) -> bool:
        """Whether the router may pick this replica now."""
        b = self._by_replica.get(replica_id)
        if b is None or b.state is BreakerState.CLOSED:
            return True
        if b.state is BreakerState.OPEN:
            return now - b.opened_at >= self.cooldown_s
        return False  # HALF_OPEN: its one probe is out

    def retry_after_s(self, replica_ids: Iterable[str], now: float) -> float | None:
        """Seconds until one of these replicas may be probed; None if none is OPEN."""
        waits = [
            self.cooldown_s - (now - b.opened_at)
            for rid in replica_ids
            if (b := self._by_replica.get(rid)) is not None and b.state is BreakerState.OPEN
        ]
        return max(0.0, min(waits)) if waits else None

    def picked(self, replica_id: str, now: float) -> None:
        """The router chose this replica: an OPEN one past its cool-down becomes the probe."""
        b = self._by_replica.get(replica_id)
        if b is not None and b.state is BreakerState.OPEN and now - b.opened_at >= self.cooldown_s:
            b.state = BreakerState.HALF_OPEN

    def success(self, replica_id: str) -> None:
        b = self._by_replica.get(replica_id)
        if b is None:
            return
        if b.state is BreakerState.OPEN:
            return  # a request sent before the replica was ejected; the probe decides
        del self._by_replica[replica_id]  # CLOSED with no failures: no entry

    def failure(self, replica_id: str, now: float) -> None:
        b = self._by_replica.get(replica_id)
        if b is None:
            b = self._by_replica[replica_id] = _Breaker()
        if b.state is BreakerState.OPEN:
            return
        b.failures += 1
        if b.state is BreakerState.HALF_OPEN or b.failures >= self.threshold:
            b.state = BreakerState.OPEN
            b.opened_at = now
            self.ejections[replica_id] = self.ejections.get(replica_id, 0) + 1

    def neutral(self, replica_id: str) -> None:
        """A request ended without a verdict; a HALF_OPEN probe slot is given back."""
        b = self._by_replica.get(replica_id)
        if b is not None and b.state is BreakerState.HALF_OPEN:
            b.state = BreakerState.OPEN
            b.opened_at = -float("inf")  # probe again at the next pick

    def forget(self, live: Iterable[str]) -> None:
        """Drop breakers of replicas that left the routing table (ids are never reused)."""
        keep = set(live)
        for rid in [r for r in self._by_replica if r not in keep]:
            del self._by_replica[rid]
        for rid in [r for r in self.ejections if r not in keep]:
            del self.ejections[rid]


class RetryBudget:
    """A token bucket: each request earns ``ratio`` of a retry, each retry spends one.

    It starts full at ``burst`` and never holds more, so at most ``burst`` retries happen
    before traffic earns more, and in steady state retries stay under ``ratio`` x requests;
    a dead replica cannot multiply the load on the living ones.
    """

    def __init__(self, ratio: float = 0.2, burst: int = 10) -> None:
        self.ratio = ratio
        self.burst = float(burst)
        self.tokens = float(burst)

    def earn(self) -> None:
        tokens = self.tokens + self.ratio
        self.tokens = tokens if tokens < self.burst else self.burst

    def spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
