"""Continuity decisions (pure): replacements, backoff, crash loops, handover, LOST, --for."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from xhpc.broker.plan.continuity import LIVE, Desire, Member, decide, handover_lead
from xhpc.models import ReplicaState as S
from xhpc.models import RestartPolicy as R
from xhpc.settings import LifecycleConfig

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
CFG = LifecycleConfig(backoff_s=5, backoff_max_s=60, crash_loop_starts=3, handover_floor_s=120)


def m(rid: str, state: S, *, age_s: float = 0, **kw: Any) -> Member:
    at = NOW - timedelta(seconds=age_s)
    fields: dict[str, Any] = {"created_at": at - timedelta(seconds=30), "updated_at": at, **kw}
    return Member(replica_id=rid, state=state, **fields)


def want(n: int = 1, policy: R = R.ALWAYS, **kw: Any) -> Desire:
    return Desire(name="m", wanted=n, restart=policy, **kw)


SERVED = {"ready_at": NOW - timedelta(hours=1)}


def test_a_deployment_at_its_count_needs_nothing() -> None:
    d = decide(
        want(2), [m("m-0", S.READY, **SERVED), m("m-1", S.QUEUED)], CFG, NOW, ever_ready=True
    )
    assert d.empty


def test_a_failed_replica_is_replaced_after_its_backoff_avoiding_its_node() -> None:
    failed = m("m-0", S.FAILED, age_s=1, node="n2", **SERVED)
    d = decide(want(2), [failed, m("m-1", S.READY, **SERVED)], CFG, NOW, ever_ready=True)
    assert d.launch == 0 and d.wait_s is not None and 3.9 < d.wait_s <= 4.0
    later = NOW + timedelta(seconds=5)
    d = decide(want(2), [failed, m("m-1", S.READY, **SERVED)], CFG, later, ever_ready=True)
    assert d.launch == 1 and d.avoid == ("n2",)


def test_backoff_doubles_with_each_recent_failure_up_to_the_cap() -> None:
    fails = [m(f"m-{i}", S.FAILED, age_s=10 - i, **SERVED) for i in range(4)]
    d = decide(want(1), fails, CFG, NOW, ever_ready=True)
    # 4 failures: 5 * 2**3 = 40 s after the last one (which was 7 s ago).
    assert d.wait_s is not None and abs(d.wait_s - 33) < 0.01
    many = [m(f"m-{i}", S.FAILED, age_s=1, **SERVED) for i in range(9)]
    d = decide(want(1), many, CFG, NOW, ever_ready=True)
    assert d.wait_s is not None and d.wait_s <= CFG.backoff_max_s


def test_three_failed_starts_in_the_window_fail_the_deployment_with_the_last_reason() -> None:
    starts = [m(f"m-{i}", S.FAILED, age_s=30 - i, reason=f"engine exited {i}") for i in range(3)]
    d = decide(want(1), [m("m-9", S.STOPPED, **SERVED), *starts], CFG, NOW, ever_ready=True)
    assert d.fail is not None and "3 failed starts" in d.fail and "engine exited 2" in d.fail
    assert d.launch == 0


def test_failed_starts_outside_the_window_do_not_count() -> None:
    old = [m(f"m-{i}", S.FAILED, age_s=CFG.crash_loop_window_s + 10) for i in range(3)]
    d = decide(want(1), old, CFG, NOW, ever_ready=True)
    assert d.fail is None and d.launch == 1


def test_never_does_not_replace_and_on_failure_replaces_only_failures() -> None:
    failed = [m("m-0", S.FAILED, age_s=100, **SERVED)]
    assert decide(want(1, R.NEVER), failed, CFG, NOW, ever_ready=True).launch == 0
    assert decide(want(1, R.ON_FAILURE), failed, CFG, NOW, ever_ready=True).launch == 1
    stopped = [m("m-0", S.STOPPED, age_s=100, **SERVED)]
    assert decide(want(1, R.ON_FAILURE), stopped, CFG, NOW, ever_ready=True).launch == 0
    assert decide(want(1, R.ALWAYS), stopped, CFG, NOW, ever_ready=True).launch == 1


def test_a_deployment_that_never_served_is_not_restarted() -> None:
    d = decide(want(1), [m("m-0", S.FAILED, age_s=100)], CFG, NOW, ever_ready=False)
    assert d.launch == 0


def test_lost_counts_within_its_grace_then_is_given_up_and_replaced() -> None:
    lost = m("m-0", S.LOST, age_s=10, **SERVED)
    assert decide(want(1), [lost], CFG, NOW, ever_ready=True).empty
    gone = m("m-0", S.LOST, age_s=CFG.lost_grace_s + 1, **SERVED)
    d = decide(want(1), [gone], CFG, NOW, ever_ready=True)
    assert d.expire == ("m-0",) and d.launch == 1


def test_the_for_time_ends_the_deployment() -> None:
    d = decide(want(1, until_at=NOW), [m("m-0", S.READY, **SERVED)], CFG, NOW, ever_ready=True)
    assert d.end is not None


# -- walltime handover ----------------------------------------------------------------------------
def test_a_successor_is_submitted_at_the_lead_before_the_end() -> None:
    early = m("m-0", S.READY, ends_at=NOW + timedelta(seconds=200), **SERVED)
    assert decide(want(1), [early], CFG, NOW, ever_ready=True).empty
    due = m("m-0", S.READY, ends_at=NOW + timedelta(seconds=100), **SERVED)
    d = decide(want(1), [due], CFG, NOW, ever_ready=True)
    assert d.successors == ("m-0",) and d.launch == 0


def test_the_lead_covers_the_measured_queue_wait_and_engine_start() -> None:
    slow = m("m-0", S.READY, ready_at=NOW, created_at=NOW - timedelta(seconds=300))
    assert handover_lead([slow], CFG) == timedelta(seconds=450)
    assert handover_lead([], CFG) == timedelta(seconds=CFG.handover_floor_s)


def test_a_successor_counts_once_with_its_predecessor_and_retires_it_when_ready() -> None:
    pred = m("m-0", S.READY, ends_at=NOW + timedelta(seconds=60), **SERVED)
    queued = m("m-1", S.QUEUED, successor_of="m-0", reason="Resources")
    d = decide(want(1), [pred, queued], CFG, NOW, ever_ready=True)
    assert d.launch == 0 and d.successors == () and d.retire == ()
    assert d.notes and "m-1 is QUEUED (Resources)" in d.notes[0][1]
    ready = m("m-1", S.READY, successor_of="m-0", **SERVED)
    d = decide(want(1), [pred, ready], CFG, NOW, ever_ready=True)
    assert d.retire == (("m-0", "m-1"),) and d.launch == 0


def test_no_handover_under_never() -> None:
    due = m("m-0", S.READY, ends_at=NOW + timedelta(seconds=10), **SERVED)
    assert decide(want(1, R.NEVER), [due], CFG, NOW, ever_ready=True).empty


@pytest.mark.parametrize("seed", range(200))
def test_never_more_replicas_than_wanted(seed: int) -> None:
    rnd = random.Random(seed)
    wanted = rnd.randint(0, 6)
    members = [
        m(f"m-{i}", rnd.choice(list(S)), age_s=rnd.randint(0, 1000), **rnd.choice([SERVED, {}]))
        for i in range(rnd.randint(0, 12))
    ]
    d = decide(want(wanted), members, CFG, NOW, ever_ready=True)
    counted = [x for x in members if x.state in LIVE and x.replica_id not in d.expire]
    assert d.launch >= 0
    assert d.launch == 0 or len(counted) + d.launch == wanted


def test_successors_wait_out_the_backoff_and_stop_after_a_crash_loop() -> None:
    pred = m("m-0", S.READY, ends_at=NOW + timedelta(seconds=60), **SERVED)
    failed = m("m-1", S.FAILED, age_s=1, successor_of="m-0")
    d = decide(want(1), [pred, failed], CFG, NOW, ever_ready=True)
    assert d.successors == () and d.wait_s is not None
    crashed = [m(f"m-{i}", S.FAILED, age_s=100 - i, successor_of="m-0") for i in range(1, 4)]
    d = decide(want(1), [pred, *crashed], CFG, NOW, ever_ready=True)
    # The predecessor serves on (no failure while it lives), and no more successors are tried.
    assert d.successors == () and d.fail is None and d.launch == 0
