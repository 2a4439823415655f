"""Small asyncio helpers shared by the long-running processes (foundation)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any


@contextlib.contextmanager
def stop_on_signals(
    stop: asyncio.Event, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[None]:
    """Within the block, ``signals`` set ``stop`` (where the loop can take handlers: the main
    thread of a Unix process); the handlers are removed on exit."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in signals:
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            continue  # not the main thread, or no signal support here
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def greeted(host: str, port: int, greeting: bytes, timeout_s: float) -> bool:
    """Does whoever listens on ``host:port`` write ``greeting`` (one line) within
    ``timeout_s``? Refused, reset, unreachable, silent or another line: no."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            line = await reader.readline()
        return line == greeting
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class OneAtATime:
    """A background pass that runs once at a time: ``start`` skips while the last one runs
    (the caller's next turn starts it again); ``stop`` cancels it and waits."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    def start(self, make: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Start ``make()`` unless a pass runs; whether it started."""
        if self.task is not None and not self.task.done():
            return False
        self.task = asyncio.create_task(make())
        return True

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
