"""Durations and what is coming for a replica, as a person reads them (pure, stdlib only: `xhpc
ps` imports it on its fast path, with no pydantic)."""

from __future__ import annotations

from datetime import UTC, datetime


def span(seconds: float) -> str:
    """A duration as a person reads it: 45s, 12m05s, 3h04m, 2d03h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def coming(
    state: str,
    start_estimate: datetime | None,
    time_left_s: float | None,
    now: datetime,
) -> str:
    """A replica's next step in one cell: a queued one's start estimate ("starts in 12m05s at
    14:03:27 UTC", "start not estimated yet"), a running one's time left ("45m00s left");
    "-" for the rest."""
    if state == "QUEUED":
        if start_estimate is None:
            return "start not estimated yet"
        left = (start_estimate - now).total_seconds()
        at = start_estimate.astimezone(UTC).strftime("%H:%M:%S")
        return f"starts in {span(left)} at {at} UTC" if left > 0 else f"start due ({at} UTC)"
    if time_left_s is not None and state in ("STARTING", "READY", "DRAINING", "LOST"):
        return f"{span(time_left_s)} left"
    return "-"
