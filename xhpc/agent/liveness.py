"""The agent's liveness port: how the gateway tells a lost job from an engine that died.

When a connection to an engine breaks after the request was sent and before any byte of an
answer, the gateway must decide whether to send the request to another replica. If the engine
died while running it, the request may be what killed it, and it is never sent elsewhere (one
poison request must not take down every replica in turn). If the whole job is gone (its node
failed, or the job was killed with everything in it), the request had nothing to do with it and
may go to another replica before the client sees anything.

The agent outlives its engine (it reports the engine's exit, then ends), so the gateway asks
the agent: it connects to this port, and a live agent writes ``AGENT_GREETING`` and closes. No
answer (refused, reset, unreachable, silent) means the job is gone. The port carries nothing
else and reads nothing, so it gives no one anything.
"""

from __future__ import annotations

import asyncio
import contextlib

from xhpc.models import AGENT_GREETING


class LivenessPort:
    """A TCP listener that greets each connection and closes it."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str = "0.0.0.0") -> int:
        self.server = await asyncio.start_server(self._greet, host, 0, backlog=64)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def _greet(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.write(AGENT_GREETING)
            await writer.drain()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError):
                await self.server.wait_closed()
            self.server = None
