"""Time in one place: tz-aware UTC timestamps and a monotonic clock."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import overload


def utcnow() -> datetime:
    return datetime.now(UTC)


def monotonic() -> float:
    return time.monotonic()


@overload
def aware(value: datetime) -> datetime: ...
@overload
def aware(value: None) -> None: ...
def aware(value: datetime | None) -> datetime | None:
    """``value`` as UTC-aware: SQLite gives back naive datetimes for what xhpc stored as UTC."""
    return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)
