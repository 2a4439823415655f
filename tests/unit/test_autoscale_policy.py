"""The scaling policy (``xhpc.broker.plan.autoscale``) on recorded demand curves: it leads a
ramp by the start's lead, holds under noise, comes down one replica at a time after a lull,
sleeps when idle and wakes on a request, and never leaves its caps."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xhpc.broker.plan.autoscale import DOWN_FILL, Sample, Verdict, decide
from xhpc.models import ScalingPolicy

STEP_S = 2.0  # one sample per reconcile pass of the simulation


def replay(
    policy: ScalingPolicy,
    load: Callable[[float], float],
    seconds: float,
    *,
    lead_s: float = 60.0,
    start: int = 1,
    cap: int | None = None,
    begun: Callable[[float], int] | None = None,
) -> list[tuple[float, int, Verdict]]:
    """Replay a demand curve: each pass samples the load, decides, and applies the count at
    once (as the broker does: replicas count from their submission). Returns (t, count after,
    verdict) for every pass."""
    samples: list[Sample] = []
    current, last_change = start, None
    out = []
    t = 0.0
    while t <= seconds:
        n = max(0, round(load(t)))
        count = begun(t) if begun is not None else int(t)  # requests keep beginning
        samples.append(Sample(at=t, in_flight=n, begun=count))
        samples = [s for s in samples if s.at >= t - 3600]
        v = decide(policy, samples, current, lead_s=lead_s, now=t, last_change_at=last_change,
                   cap=cap)  # fmt: skip
        if v.wanted != current:
            current, last_change = v.wanted, t
        out.append((t, current, v))
        t += STEP_S
    return out


def changes(run: list[tuple[float, int, Verdict]]) -> int:
    return sum(1 for a, b in itertools.pairwise(run) if a[1] != b[1])


def test_steady_noisy_demand_never_flaps() -> None:
    """Two hours of demand around 6 in flight (target 4 per replica: two replicas), noise of
    +-3 on every sample: the count settles once and holds."""
    rng = random.Random(7)
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, target_in_flight=4)
    run = replay(policy, lambda t: 6 + rng.uniform(-3, 3), 7200)
    settled = [c for t, c, _ in run if t >= 600]
    assert set(settled) == {settled[0]} and 2 <= settled[0] <= 3
    assert changes(run) <= 2


def test_a_ramp_is_led_by_the_start_s_lead() -> None:
    """Demand rising 1 request per 10 s: each replica is asked for at least the lead before
    the demand needs it (lead 60 s)."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=20, target_in_flight=4)
    lead = 60.0
    run = replay(policy, lambda t: t / 10, 600, lead_s=lead)
    asked_at: dict[int, float] = {}
    for t, c, _ in run:
        for n in range(2, c + 1):
            asked_at.setdefault(n, t)
    for n, t in asked_at.items():
        needed_at = (n - 1) * 4 * 10  # the load first exceeds n-1 replicas' target here
        if needed_at > lead + 60:  # once the trend is measured
            assert t <= needed_at - lead * 0.8, (n, t, needed_at)


def test_after_a_burst_it_comes_down_one_at_a_time_and_only_after_the_window() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=10, target_in_flight=4, down_window_s=300)
    run = replay(policy, lambda t: 30 if t < 300 else 2, 2400)
    peak = max(c for _, c, _ in run)
    assert peak == 8  # 30 in flight at 4 each
    downs = [(t, c) for (t0, c0, _), (t, c, _) in itertools.pairwise(run) if c < c0]
    assert all(b == a - 1 for (_, a), (_, b) in zip([(0, peak), *downs], downs, strict=False))
    assert downs[0][0] >= 300 + 300  # the burst's peak leaves the window first
    assert all(t2 - t1 >= 300 for (t1, _), (t2, _) in itertools.pairwise(downs))
    assert run[-1][1] == 1


def test_idle_goes_to_the_floor_and_a_request_wakes_it() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=4, idle_s=600)
    quiet_from = 100.0
    run = replay(policy, lambda t: 0 if t >= quiet_from else 2, 2000,
                 begun=lambda t: int(min(t, quiet_from)))  # fmt: skip
    asleep = [t for t, c, v in run if c == 0]
    assert asleep and asleep[0] >= quiet_from + 600 and run[-1][1] == 0
    assert next(v for _, c, v in run if c == 0).why == "idle"
    woke = decide(policy, [Sample(at=0, in_flight=0), Sample(at=5, held=1)], 0, lead_s=60,
                  now=5, last_change_at=0)  # fmt: skip
    assert (woke.wanted, woke.why) == (1, "wake")
    still = decide(policy, [Sample(at=5)], 0, lead_s=60, now=5, last_change_at=0)
    assert (still.wanted, still.why) == (0, "asleep")


def test_a_saturated_engine_asks_for_one_more() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, target_in_flight=16, ttft_s=2.0)
    full = decide(policy, [Sample(at=0, in_flight=3, kv_use=0.95)], 1, lead_s=60, now=0,
                  last_change_at=None)  # fmt: skip
    slow = decide(policy, [Sample(at=0, in_flight=3, ttft_s=5.0)], 2, lead_s=60, now=0,
                  last_change_at=None)  # fmt: skip
    assert (full.wanted, full.why) == (2, "saturated")
    assert (slow.wanted, slow.why) == (3, "saturated")


def test_the_verdict_is_one_line_with_its_inputs() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=4)
    v = decide(policy, [Sample(at=0, in_flight=9)], 1, lead_s=75, now=0, last_change_at=None)
    line = v.line("llama", 1)
    assert "\n" not in line
    assert line.startswith("autoscale deployment=llama replicas=1 wanted=3 why=demand ")
    for word in ("load=9", "projected=9", "lead_s=75", "target=4", "max=4", "kv_use=-"):
        assert word in line.split(), line


def test_a_policy_s_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        ScalingPolicy(max_replicas=0)


@settings(max_examples=150, deadline=None)
@given(
    lo=st.integers(0, 3),
    extra=st.integers(0, 5),
    cap=st.one_of(st.none(), st.integers(0, 10)),
    loads=st.lists(st.integers(0, 200), min_size=1, max_size=40),
    current=st.integers(0, 12),
    kv=st.one_of(st.none(), st.floats(0, 1)),
)
def test_caps_are_never_left(
    lo: int, extra: int, cap: int | None, loads: list[int], current: int, kv: float | None
) -> None:
    policy = ScalingPolicy(min_replicas=lo, max_replicas=max(1, lo + extra), target_in_flight=4)
    samples = [Sample(at=float(i), in_flight=n, kv_use=kv) for i, n in enumerate(loads)]
    v = decide(policy, samples, current, lead_s=30, now=float(len(loads)), last_change_at=None,
               cap=cap)  # fmt: skip
    top = policy.max_replicas if cap is None else min(policy.max_replicas, cap)
    assert min(policy.min_replicas, top) <= v.wanted <= top
    assert not math.isnan(float(v.inputs["load"] or 0))


def test_down_uses_a_lower_fill_than_up() -> None:
    """The hysteresis band: a load that brought a second replica does not take it away."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, target_in_flight=4, down_window_s=60)
    samples = [Sample(at=float(t), in_flight=5) for t in range(0, 200, 2)]
    v = decide(policy, samples, 2, lead_s=30, now=198, last_change_at=0)
    assert (v.wanted, v.why) == (2, "hold")
    assert 4 * DOWN_FILL < 5 <= 8


def test_the_sites_windows_set_how_soon_a_step_is_followed() -> None:
    """A step from nothing to 3 in flight, 8 s ago, on one replica at 1 per replica: the mean of
    30 s (0.8) and a minute's trend ask for less than the step needs, the mean of 5 s for all."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, target_in_flight=1)
    samples = [Sample(at=t, in_flight=0 if t < 92 else 3, begun=t) for t in range(0, 101)]
    slow = decide(policy, samples, 1, lead_s=10, now=100, last_change_at=None)
    quick = decide(policy, samples, 1, lead_s=10, now=100, last_change_at=None, smooth_s=5)
    steep = decide(policy, samples, 1, lead_s=10, now=100, last_change_at=None, smooth_s=5,
                   trend_min_s=10)  # fmt: skip
    assert slow.wanted < 3 == quick.wanted and quick.why == "demand"
    assert slow.inputs["load"] == 0.87 and quick.inputs["load"] == 3
    # A 10 s trend reads the step as a steep ramp: projected 6 in flight, up to the maximum.
    assert steep.wanted == 4 and float(steep.inputs["projected"] or 0) > 6
