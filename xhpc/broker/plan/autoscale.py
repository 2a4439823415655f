"""How many replicas a deployment with a scaling policy wants (pure): from the gateways' demand
and its engines' own metrics, ahead of Slurm's queue, with hysteresis.

The broker samples each scaled deployment's demand every reconcile pass (:class:`Sample`: the
requests in flight through the gateways, the engines' queued and running requests, their
KV-cache use and time to first token, and a counter of requests begun). :func:`decide` turns the
recent samples, the replicas the deployment counts now and the lead (how long a new replica takes
to serve: the queue estimate plus the engine's start, from its history) into one
:class:`Verdict`: a replica count and the inputs it was decided on, which the broker logs as one
line and applies through the same scaling as `xhpc scale`.

- **Up, ahead of demand.** The load is the requests in flight plus those held and those the
  engines queue. Once the recent load (the mean of the last ``SMOOTH_S``) passes the replicas'
  target by ``UP_MARGIN``, or the load projected ``lead_s`` ahead passes it, the count wanted is
  that load divided by the target per replica, rounded up. The projection follows the recent
  trend (a least-squares line over the lead, a minute at least), only where the line explains
  the load (correlation ``TREND_R``: noise is no trend). A saturated engine (KV cache at
  ``KV_FULL`` or more, or its time to first token over the objective) asks for one more. Up is
  applied at once: a replica asked for late is minutes late.
- **Down, slowly.** One replica fewer only when the peak load of the last ``down_window_s``
  would fit in one replica fewer at ``DOWN_FILL`` of the target (the hysteresis band between
  up and down), and no change was made for that window; one replica at a time.
- **Idle, to the floor.** No request begun for ``idle_s`` and none in flight: down to the
  policy's minimum (0: asleep, woken by the next request).
- **A sleeping deployment wakes** on any request in flight or held: at least one replica.
- **Caps.** Never under the minimum, never over the maximum or the site's and the account's cap
  (``cap``, the most the broker may have now).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from xhpc.models import Frozen, ScalingPolicy

SMOOTH_S = 30.0  # the recent load is the mean over this (`[autoscale] smooth_s`)
UP_MARGIN = 1.1  # up only once the load passes the replicas' target by this much
TREND_R = 0.6  # a trend counts only if it explains the load this well (correlation)
TREND_MIN_S = 60.0  # the trend is fitted over at least this and the lead (`trend_min_s`)
KV_FULL = 0.9  # an engine whose KV cache is this full is saturated
DOWN_FILL = 0.7  # one fewer only if the peak fits at this fraction of the target


class Sample(Frozen):
    """A deployment's demand at one moment (``at``: monotonic seconds)."""

    at: float
    in_flight: int = Field(default=0, ge=0)  # through the gateways, all its replicas
    held: int = Field(default=0, ge=0)  # requests the gateways hold for it (asleep, waking)
    waiting: int = Field(default=0, ge=0)  # queued in its engines
    running: int = Field(default=0, ge=0)  # running in its engines
    begun: int = Field(default=0, ge=0)  # requests begun so far (a counter)
    kv_use: float | None = Field(default=None, ge=0, le=1)  # the fullest engine's KV cache
    ttft_s: float | None = Field(default=None, ge=0)  # p90 time to first token, recent

    @property
    def load(self) -> int:
        """The calls it has to answer: those its engines hold (the gateways' in flight, or the
        engines' own running and queued, whichever is more), and those held for a replica."""
        return max(self.in_flight, self.running + self.waiting) + self.held


class Verdict(Frozen):
    """The replica count wanted, why, and what it was decided on (one log line)."""

    wanted: int
    why: str
    inputs: dict[str, float | int | str | None]

    def line(self, deployment: str, current: int) -> str:
        shown = " ".join(f"{k}={_shown(v)}" for k, v in self.inputs.items())
        return (
            f"autoscale deployment={deployment} replicas={current} wanted={self.wanted} "
            f"why={self.why} {shown}"
        )


def _shown(v: float | int | str | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _trend(
    points: Sequence[tuple[float, float]], at: float, min_s: float = TREND_MIN_S
) -> tuple[float, float] | None:
    """The least-squares line through (t, y): its value at ``at`` and its slope; None for points
    that span under ``min_s / 2`` or number under six, or a line that does not explain them
    (correlation under ``TREND_R``: noise, not a trend)."""
    if len(points) < 6 or points[-1][0] - points[0][0] < min_s / 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    vt = sum((t - mt) ** 2 for t, _ in points)
    vy = sum((y - my) ** 2 for _, y in points)
    if vt <= 0 or vy <= 0:
        return None
    cov = sum((t - mt) * (y - my) for t, y in points)
    if cov / math.sqrt(vt * vy) < TREND_R:
        return None
    slope = cov / vt
    return my + slope * (at - mt), slope


def _need(load: float, per_replica: float) -> int:
    return math.ceil(load / per_replica - 1e-9) if load > 0 else 0


def decide(
    policy: ScalingPolicy,
    samples: Sequence[Sample],
    current: int,
    *,
    lead_s: float,
    now: float,
    last_change_at: float | None,
    cap: int | None = None,
    smooth_s: float = SMOOTH_S,
    trend_min_s: float = TREND_MIN_S,
) -> Verdict:
    """The replicas ``policy`` wants now, from ``samples`` (oldest first, up to ``now``), with
    ``current`` replicas counted (queued, starting or serving) and a new one ``lead_s`` from
    serving; ``last_change_at``: when the count last changed (None: never). ``smooth_s`` and
    ``trend_min_s``: the site's windows for the recent load and the trend (`[autoscale]`)."""
    top = policy.max_replicas if cap is None else max(0, min(policy.max_replicas, cap))
    floor = min(policy.min_replicas, top)
    target = policy.target
    recent = [s for s in samples if s.at >= now - smooth_s] or list(samples[-1:])
    last = samples[-1] if samples else None
    load_now = sum(s.load for s in recent) / len(recent) if recent else 0.0
    span = max(trend_min_s, lead_s)
    trend = _trend([(s.at, float(s.load)) for s in samples if s.at >= now - span], now, trend_min_s)
    slope = trend[1] if trend is not None else 0.0
    projected = max(load_now, trend[0] + slope * lead_s) if trend is not None else load_now
    window = [s for s in samples if s.at >= now - policy.down_window_s]
    peak = max((s.load for s in window), default=0)
    begun_then = next((s.begun for s in samples if s.at >= now - policy.idle_s), None)
    covers_idle = bool(samples) and samples[0].at <= now - policy.idle_s
    idle = (
        covers_idle
        and last is not None
        and last.load == 0
        and last.running == 0
        and begun_then is not None
        and last.begun == begun_then
    )
    saturated = last is not None and (
        (last.kv_use is not None and last.kv_use >= KV_FULL)
        or (policy.ttft_s is not None and last.ttft_s is not None and last.ttft_s > policy.ttft_s)
    )
    inputs: dict[str, float | int | str | None] = {
        "load": round(load_now, 2),
        "projected": round(projected, 2),
        "slope_per_s": round(slope, 4),
        "peak": peak,
        "lead_s": round(lead_s, 1),
        "target": target,
        "kv_use": last.kv_use if last else None,
        "ttft_s": last.ttft_s if last else None,
        "min": floor,
        "max": top,
    }

    def verdict(wanted: int, why: str) -> Verdict:
        return Verdict(wanted=max(floor, min(top, wanted)), why=why, inputs=inputs)

    if current == 0:  # asleep: woken for the calls waiting now (not the traffic before it)
        if last is not None and last.load > 0:
            return verdict(max(1, _need(last.load, target)), "wake")
        return verdict(0, "asleep")
    if idle:
        return verdict(floor, "idle")
    # The margin keeps noise out; a trend is no noise (the line explains the load).
    up = current
    if load_now > current * target * UP_MARGIN:
        up = _need(load_now, target)
    if trend is not None and projected > current * target:
        up = max(up, _need(projected, target))
    if saturated:
        up = max(up, current + 1)
    if up > current:
        return verdict(up, "saturated" if saturated and up == current + 1 else "demand")
    settled = last_change_at is None or now - last_change_at >= policy.down_window_s
    covered = bool(samples) and samples[0].at <= now - policy.down_window_s
    fits = peak <= (current - 1) * target * DOWN_FILL
    if current > 1 and settled and covered and not saturated and fits:
        return verdict(current - 1, "low")
    return verdict(current, "hold")
