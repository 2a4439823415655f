"""Time in one place: tz-aware UTC timestamps and a monotonic clock."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def monotonic() -> float:
    return time.monotonic()
