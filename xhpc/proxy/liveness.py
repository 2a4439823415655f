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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from urllib.parse import urlsplit

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
        self._memo: dict[str, tuple[float, bool]] = {}  # replica -> (when, gone)
        self._asking: dict[str, asyncio.Future[bool]] = {}  # questions under way

    async def gone(self, route: Route) -> bool:
        """True when the replica's agent does not answer: its job is gone."""
        host = urlsplit(route.url).hostname
        if route.agent_port is None or not host:
            return False
        rid = route.replica_id
        memo = self._memo.get(rid)
        if memo is not None and self.clock() - memo[0] < self.memo_s:
            return memo[1]
        asking = self._asking.get(rid)
        if asking is None:  # one question per replica; a caller that leaves does not end it
            asking = asyncio.ensure_future(self._ask(rid, host, route.agent_port))
            self._asking[rid] = asking
        return await asyncio.shield(asking)

    async def _ask(self, rid: str, host: str, port: int) -> bool:
        try:
            answer = not await self._greeted(host, port)
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[rid] = (self.clock(), answer)
            return answer
        finally:
            self._asking.pop(rid, None)

    async def _greeted(self, host: str, port: int) -> bool:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
                line = await reader.readline()
            return line == AGENT_GREETING
        except (OSError, TimeoutError, ValueError):
            return False
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
