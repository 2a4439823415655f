"""Samples to figures, pure: the broker's samples (routes and READY replicas every POLL_S) give
the time a replica took to leave the routing table, whether and when capacity came back, and
the longest stretch without any route; the proxy's log gives its first failed connect to a
replica; the traffic's outcomes give the requests sent, failed and truncated, plain and
streamed apart. Tested on recorded samples (tests/test_bench_continuity.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.cluster.traffic import Outcome


@dataclass(frozen=True)
class Sample:
    """One poll of the broker: ``routed`` the model's replicas in the routing table, ``ready``
    its READY replicas; None when the broker did not answer."""

    t: float  # monotonic
    routed: frozenset[str] | None
    ready: int | None


def out_of_rotation(samples: Sequence[Sample], victim: str, fault: float) -> float | None:
    """Fault -> the first sample at or after it whose routing table lacks ``victim``."""
    for s in samples:
        if s.t >= fault and s.routed is not None and victim not in s.routed:
            return s.t - fault
    return None


def restored(samples: Sequence[Sample], before: int, fault: float) -> tuple[bool, float | None]:
    """(whether the READY count fell below ``before`` after the fault, fault -> the first sample
    with ``before`` READY again after that fall; None if it did not come back)."""
    dropped = False
    for s in samples:
        if s.t < fault or s.ready is None:
            continue
        if not dropped and s.ready < before:
            dropped = True
        elif dropped and s.ready >= before:
            return True, s.t - fault
    return dropped, None


def route_gap(samples: Sequence[Sample], since: float) -> float:
    """The longest stretch (between samples) during which the model had no route at all."""
    longest = 0.0
    empty_since: float | None = None
    for s in samples:
        if s.t < since or s.routed is None:
            continue
        if not s.routed:
            empty_since = s.t if empty_since is None else empty_since
            longest = max(longest, s.t - empty_since)
        else:
            if empty_since is not None:
                longest = max(longest, s.t - empty_since)
            empty_since = None
    return longest


_FAILED_CONNECT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \w+ "
    r"(?:replica (\S+) unreachable: (\w*Connect\w*)|connecting to replica (\S+) timed out)"
)


def first_failed_connect(proxy_log: str, replica: str, since_epoch: float) -> float | None:
    """The wall time (epoch) of the proxy's first failed connection to ``replica`` at or after
    ``since_epoch``, from its log lines (``replica R unreachable: ...Connect...``, ``connecting to
    replica R timed out``; local time, ms)."""
    for line in proxy_log.splitlines():
        m = _FAILED_CONNECT.match(line)
        if not m or replica not in (m.group(2), m.group(4)):
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= since_epoch - 0.0005:  # the log has ms
            return at
    return None


def traffic_figures(outcomes: Sequence[Outcome], fault: float | None) -> dict[str, Any]:
    plain = [o for o in outcomes if not o.stream]
    streams = [o for o in outcomes if o.stream]
    bad = [o for o in outcomes if not o.ok]
    ref = fault if fault is not None else (outcomes[0].at if outcomes else 0.0)
    return {
        "sent": {"plain": len(plain), "stream": len(streams)},
        "failed": {"plain": sum(not o.ok for o in plain), "stream": sum(not o.ok for o in streams)},
        "truncated": sum(o.truncated for o in outcomes),
        "failures": [
            {
                "at_s": round(o.at - ref, 3),  # sent, relative to the fault
                "stream": o.stream,
                "status": o.status,
                "truncated": o.truncated,
                "detail": o.detail[:200],
            }
            for o in bad[:20]
        ],
    }


def logged_at(log_text: str, needle: str) -> float | None:
    """The wall time (epoch) of the first log line holding ``needle`` (local time, ms)."""
    for line in log_text.splitlines():
        if needle in line:
            try:
                return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
    return None
