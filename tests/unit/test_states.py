"""The replica state machine, table-driven: every (current, target) pair is either legal or not."""

from __future__ import annotations

import itertools

import pytest

from xhpc.errors import StateTransitionError
from xhpc.models import ReplicaState as S
from xhpc.states import ACTIVE, TERMINAL, TRANSITIONS, can_transition, check_transition

# The intended machine, written out independently of xhpc.states.
LEGAL: set[tuple[S, S]] = {
    (S.CREATING, S.QUEUED), (S.CREATING, S.FAILED), (S.CREATING, S.STOPPED),
    (S.QUEUED, S.STARTING), (S.QUEUED, S.DRAINING), (S.QUEUED, S.FAILED),
    (S.QUEUED, S.STOPPED), (S.QUEUED, S.LOST),
    (S.STARTING, S.READY), (S.STARTING, S.DRAINING), (S.STARTING, S.FAILED),
    (S.STARTING, S.STOPPED), (S.STARTING, S.LOST), (S.STARTING, S.QUEUED),
    (S.READY, S.DRAINING), (S.READY, S.FAILED), (S.READY, S.STOPPED), (S.READY, S.LOST),
    (S.READY, S.QUEUED),
    (S.DRAINING, S.STOPPED), (S.DRAINING, S.FAILED), (S.DRAINING, S.LOST),
    (S.LOST, S.STARTING), (S.LOST, S.READY), (S.LOST, S.DRAINING), (S.LOST, S.STOPPED),
    (S.LOST, S.FAILED), (S.LOST, S.QUEUED),
}  # fmt: skip
ALL_PAIRS = list(itertools.product(S, S))
ILLEGAL = [p for p in ALL_PAIRS if p not in LEGAL]


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(S)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL


@pytest.mark.parametrize(("current", "target"), sorted(LEGAL))
def test_legal_transition(current: S, target: S) -> None:
    assert can_transition(current, target)
    check_transition("r-0", current, target)  # does not raise


@pytest.mark.parametrize(("current", "target"), ILLEGAL)
def test_illegal_transition(current: S, target: S) -> None:
    assert not can_transition(current, target)
    with pytest.raises(StateTransitionError) as info:
        check_transition("r-0", current, target)
    err = info.value
    assert (err.replica_id, err.current, err.target) == ("r-0", current.value, target.value)
    assert f"{current.value} -> {target.value}" in err.one_line()


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_exits(state: S) -> None:
    assert TRANSITIONS[state] == frozenset()
    assert not any(can_transition(state, t) for t in S)


def test_active_and_terminal_partition_the_states() -> None:
    assert {S.STOPPED, S.FAILED} == TERMINAL
    assert set(S) == ACTIVE | TERMINAL
    assert not ACTIVE & TERMINAL


def test_no_self_transitions_and_nothing_returns_to_creating() -> None:
    assert not any(can_transition(s, s) for s in S)
    assert not any(can_transition(s, S.CREATING) for s in S)


def test_every_active_state_can_reach_a_terminal_state() -> None:
    for state in ACTIVE:
        assert TRANSITIONS[state] & TERMINAL, state


# -- pilots and PD units ---------------------------------------------------------------------------
from xhpc.models import PilotState as P  # noqa: E402
from xhpc.models import UnitState as U  # noqa: E402
from xhpc.states import (  # noqa: E402
    PILOT_TRANSITIONS,
    UNIT_TRANSITIONS,
    check_pilot_transition,
    check_unit_transition,
)


def test_pilot_and_unit_tables_cover_every_state_and_end_for_good() -> None:
    assert set(PILOT_TRANSITIONS) == set(P) and set(UNIT_TRANSITIONS) == set(U)
    assert PILOT_TRANSITIONS[P.ENDED] == frozenset() and UNIT_TRANSITIONS[U.ENDED] == frozenset()
    assert PILOT_TRANSITIONS[P.STOPPING] == {P.ENDED}
    assert UNIT_TRANSITIONS[U.STOPPING] == {U.ENDED}
    # A requeued pilot job runs again; a unit summing up its instances moves among live states.
    check_pilot_transition("p", P.RUNNING, P.PENDING)
    check_unit_transition("u", U.READY, U.STARTING)


@pytest.mark.parametrize(("current", "target"), [(P.ENDED, P.RUNNING), (P.STOPPING, P.RUNNING)])
def test_illegal_pilot_transitions(current: P, target: P) -> None:
    with pytest.raises(StateTransitionError, match="pilot p-1"):
        check_pilot_transition("p-1", current, target)


@pytest.mark.parametrize(("current", "target"), [(U.ENDED, U.READY), (U.STOPPING, U.DEGRADED)])
def test_illegal_unit_transitions(current: U, target: U) -> None:
    with pytest.raises(StateTransitionError, match="PD unit u-1"):
        check_unit_transition("u-1", current, target)
