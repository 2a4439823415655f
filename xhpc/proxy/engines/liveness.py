"""Is a replica's job gone, or only its engine? Asked when a sent request's connection breaks.

A connection that breaks after the request was sent and before any byte reached the client is
never retried when the engine died under the request (it may be what killed it). When the whole
job is gone (a failed node, a job killed with everything in it) the request is not to blame and
goes to another replica, so a lost node costs no request that had no answer yet.

The agent outlives its engine, so its liveness port (``Route.agent_port``, on the route's host)
tells the two apart: a greeting means the agent, hence the job, lives; anything else within
``timeout_s`` (refused, reset, silence, unreachable) means the job is gone. A replica whose
agent states no port is never judged gone. The answer is kept for ``memo_s`` per replica, and
concurrent questions about one replica share one connection: a node's loss breaks every
request in flight to it at once.

A node whose link goes down breaks nothing: its connections fall silent. :class:`JobWatch`
covers that: a request whose answer is not whole after ``after_s`` has its replica's agent
asked, and again every ``after_s``; when the job is gone, the request's task is cancelled: a
request with no byte sent yet goes to another replica, a stream under way ends with an error
event (or goes on elsewhere, when it can be continued).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from xhpc.aio import greeted
from xhpc.models import AGENT_GREETING, Route


class JobLiveness:
    def __init__(
        self,
        timeout_s: float = 1.0,
        memo_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.memo_s = memo_s
        self.clock = clock
        # (replica, host, port) -> (when, gone): a requeued replica's new run is asked anew
        self._memo: dict[tuple[str, str, int], tuple[float, bool]] = {}
        self._asking: dict[tuple[str, str, int], asyncio.Future[bool]] = {}  # under way

    async def gone(self, route: Route) -> bool:
        """True when the replica's agent does not answer: its job is gone."""
        host = urlsplit(route.url).hostname
        if route.agent_port is None or not host:
            return False
        key = (route.replica_id, host, route.agent_port)
        memo = self._memo.get(key)
        if memo is not None and self.clock() - memo[0] < self.memo_s:
            return memo[1]
        asking = self._asking.get(key)
        if asking is None:  # one question per replica; a caller that leaves does not end it
            asking = asyncio.ensure_future(self._ask(key))
            self._asking[key] = asking
        return await asyncio.shield(asking)

    async def _ask(self, key: tuple[str, str, int]) -> bool:
        try:
            answer = not await greeted(key[1], key[2], AGENT_GREETING, self.timeout_s)
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[key] = (self.clock(), answer)
            return answer
        finally:
            self._asking.pop(key, None)


class JobWatch:
    """Watches one attempt's replica while the attempt runs: from ``after_s`` on, every
    ``after_s``, asks ``liveness``; when the job is gone, cancels the task that made the watch,
    once (``fired`` tells that cancellation from any other). ``stop`` ends it. An attempt that
    ends within ``after_s`` costs one timer; a longer one, a question per replica every
    ``after_s`` (shared with every other request to it)."""

    def __init__(self, liveness: JobLiveness, route: Route, after_s: float) -> None:
        self.liveness = liveness
        self.route = route
        self.after_s = after_s
        self.fired = False
        self._task = asyncio.current_task()
        self._probe: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(after_s, self._start)

    def _start(self) -> None:
        if self._task is not None and not self._task.done():
            self._probe = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        assert self._task is not None
        while not self._task.done():
            if await self.liveness.gone(self.route):
                self.fired = True
                self._task.cancel()
                return
            await asyncio.sleep(self.after_s)

    def stop(self) -> None:
        self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()
