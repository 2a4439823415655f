"""Calls the broker makes to engines in the background (adapter loads, metrics scrapes): one
pass at a time, through one lazily opened HTTP session, both closed together."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from xhpc.aio import OneAtATime


class EngineCalls:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.passes = OneAtATime()
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    def start(self, make: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Start a background pass unless one runs (``OneAtATime.start``)."""
        return self.passes.start(make)

    async def close(self) -> None:
        await self.passes.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
