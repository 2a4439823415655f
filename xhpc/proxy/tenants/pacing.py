"""A tenant's share of the gateway's Files and Batch calls: each user's calls at a pace.

``CallPacer`` is a per-user GCRA (the generic cell rate algorithm, a token bucket kept as one
time per user): a user may make ``burst`` calls at once, then one each ``1 / per_s`` seconds.
A call over the pace is not refused but waits its turn (the client waits with it, as a
well-behaved client polling a batch never notices); a user with ``max_waiting`` calls already
waiting is refused (429) instead, so a flood cannot pile up waiting calls either. Per gateway
worker, like the keys' rates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
PRUNE_AT = 4096  # users remembered before the idle ones are forgotten


class CallPacer:
    """``turn(user)``: waits for the user's next turn; False (not waited) when too many of
    theirs already wait. ``per_s`` None: every call at once."""

    def __init__(
        self,
        per_s: float | None,
        burst: int = 20,
        max_waiting: int = 16,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if per_s is not None and per_s <= 0:
            raise ValueError("per_s must be above 0")
        self.interval = 0.0 if per_s is None else 1.0 / per_s
        self.slack = max(burst - 1, 0) * self.interval
        self.max_waiting = max_waiting
        self._clock = clock
        self._sleep = sleep
        self._due: dict[str, float] = {}  # user -> when their bucket is empty again
        self._waiting: dict[str, int] = {}

    async def turn(self, user: str) -> bool:
        if self.interval == 0.0:
            return True
        now = self._clock()
        due = max(self._due.get(user, now), now)
        wait = due - self.slack - now
        if wait > 0 and self._waiting.get(user, 0) >= self.max_waiting:
            return False
        if len(self._due) >= PRUNE_AT:
            self._due = {u: t for u, t in self._due.items() if t > now}
        self._due[user] = due + self.interval
        if wait <= 0:
            return True
        self._waiting[user] = self._waiting.get(user, 0) + 1
        try:
            await self._sleep(wait)
        finally:
            left = self._waiting[user] - 1
            if left:
                self._waiting[user] = left
            else:
                del self._waiting[user]
        return True
