"""The gateway's per-user pace of Files and Batch calls (``xhpc.proxy.tenants.pacing``)."""

from __future__ import annotations

import asyncio

import pytest

from xhpc.proxy.tenants.pacing import CallPacer


class FakeTime:
    """A clock that only moves when a caller sleeps: each sleep is recorded, then taken."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        await asyncio.sleep(0)


def test_a_burst_goes_at_once_and_the_calls_after_it_wait_their_turn() -> None:
    t = FakeTime()
    pacer = CallPacer(per_s=10.0, burst=3, clock=t.clock, sleep=t.sleep)

    async def five() -> list[bool]:
        return [await pacer.turn("ann") for _ in range(5)]

    assert asyncio.run(five()) == [True] * 5
    # Three at once (the burst), then 0.1 s, 0.2 s later than now: one each tenth of a second.
    assert t.slept == [0.1, 0.2]


def test_one_user_s_pace_never_delays_another_user() -> None:
    t = FakeTime()
    pacer = CallPacer(per_s=1.0, burst=1, clock=t.clock, sleep=t.sleep)

    async def calls() -> None:
        for _ in range(4):
            await pacer.turn("flood")
        await pacer.turn("quiet")

    asyncio.run(calls())
    assert t.slept == [1.0, 2.0, 3.0]  # the flood's three waits only; the quiet user none


def test_time_passing_refills_the_burst() -> None:
    t = FakeTime()
    pacer = CallPacer(per_s=2.0, burst=2, clock=t.clock, sleep=t.sleep)

    async def calls() -> None:
        await pacer.turn("ann")
        await pacer.turn("ann")
        t.now += 1.0  # two calls' worth of time
        await pacer.turn("ann")
        await pacer.turn("ann")

    asyncio.run(calls())
    assert t.slept == []


@pytest.mark.adversarial
@pytest.mark.security
def test_a_user_with_too_many_calls_waiting_is_refused_not_queued() -> None:
    """A flood of parallel calls cannot pile up waiting calls: past ``max_waiting`` of one
    user's calls waiting, the next is refused at once; the others still get their turn."""

    async def flood() -> list[bool]:
        gate = asyncio.Event()

        async def held(_: float) -> None:
            await gate.wait()

        pacer = CallPacer(per_s=1.0, burst=1, max_waiting=2, sleep=held)
        first = await pacer.turn("flood")  # the burst
        waiting = [asyncio.ensure_future(pacer.turn("flood")) for _ in range(2)]
        await asyncio.sleep(0)
        refused = await pacer.turn("flood")
        other = await pacer.turn("quiet")
        gate.set()
        return [first, *(await asyncio.gather(*waiting)), refused, other]

    assert asyncio.run(flood()) == [True, True, True, False, True]


def test_no_pace_lets_every_call_through_at_once() -> None:
    t = FakeTime()
    pacer = CallPacer(per_s=None, clock=t.clock, sleep=t.sleep)
    assert asyncio.run(pacer.turn("ann")) is True
    assert t.slept == []
    with pytest.raises(ValueError):
        CallPacer(per_s=0.0)
