"""The replica state machine: the only legal transitions."""

from __future__ import annotations

from xhpc.errors import StateTransitionError
from xhpc.models import ReplicaState as S

TERMINAL = frozenset({S.STOPPED, S.FAILED})
ACTIVE = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY, S.DRAINING, S.LOST})

TRANSITIONS: dict[S, frozenset[S]] = {
    S.CREATING: frozenset({S.QUEUED, S.FAILED, S.STOPPED}),
    S.QUEUED: frozenset({S.STARTING, S.DRAINING, S.FAILED, S.STOPPED, S.LOST}),
    # A job that leaves RUNNING (requeued, preempted, its node failed) takes its replica back
    # to QUEUED: out of the routing table until the job runs again and its agent registers.
    S.STARTING: frozenset({S.QUEUED, S.READY, S.DRAINING, S.FAILED, S.STOPPED, S.LOST}),
    S.READY: frozenset({S.QUEUED, S.DRAINING, S.FAILED, S.STOPPED, S.LOST}),
    S.DRAINING: frozenset({S.STOPPED, S.FAILED, S.LOST}),
    # A lost replica may be found again (its agent re-registers after a broker restart).
    S.LOST: frozenset({S.QUEUED, S.STARTING, S.READY, S.DRAINING, S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}


def can_transition(current: S, target: S) -> bool:
    return target in TRANSITIONS[current]


def check_transition(replica_id: str, current: S, target: S) -> None:
    if not can_transition(current, target):
        raise StateTransitionError(replica_id, current.value, target.value)
