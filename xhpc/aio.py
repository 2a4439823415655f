"""Small asyncio helpers shared by the long-running processes (foundation)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator


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
