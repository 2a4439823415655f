"""The state machines of replicas and of the jobs that host them: the only legal transitions."""

from __future__ import annotations

from typing import Any

from xhpc.errors import StateTransitionError
from xhpc.models import JobKind
from xhpc.models import JobState as J
from xhpc.models import PilotState as P
from xhpc.models import ReplicaState as S
from xhpc.models import UnitState as U

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


# One machine for every job that hosts replicas. A kind lives in some of the live states and
# moves freely among them: a pilot's job is PENDING or RUNNING (Slurm requeues it), a PD unit's
# state sums up its instances' (xhpc.broker.plan.units). Any live job may be stopped or end; a job
# being stopped only ends; an ended job stays ended.
LIVE_JOB_STATES: dict[JobKind, frozenset[J]] = {
    JobKind.REPLICA: frozenset({J.PENDING, J.RUNNING}),
    JobKind.PILOT: frozenset({J.PENDING, J.RUNNING}),
    JobKind.UNIT: frozenset({J.STARTING, J.READY, J.DEGRADED}),
}
FIRST_JOB_STATE: dict[JobKind, J] = {
    JobKind.REPLICA: J.PENDING,
    JobKind.PILOT: J.PENDING,
    JobKind.UNIT: J.STARTING,
}
_ENDING = frozenset({J.STOPPING, J.ENDED})
_LIVE = frozenset(s for live in LIVE_JOB_STATES.values() for s in live)
JOB_TRANSITIONS: dict[J, frozenset[J]] = {
    **{s: (_LIVE - {s}) | _ENDING for s in _LIVE},
    J.STOPPING: frozenset({J.ENDED}),
    J.ENDED: frozenset(),
}
_WHAT = {JobKind.REPLICA: "job", JobKind.PILOT: "pilot", JobKind.UNIT: "PD unit"}


def job_states(kind: JobKind) -> frozenset[J]:
    """Every state a job of ``kind`` may be in."""
    return LIVE_JOB_STATES[kind] | _ENDING


def check_job_transition(kind: JobKind, key: str, current: J, target: J) -> None:
    """A job of ``kind`` may move from ``current`` to ``target`` (staying put is no move)."""
    legal = target in JOB_TRANSITIONS[current] and target in job_states(kind)
    if current is not target and not legal:
        raise StateTransitionError(key, current.value, target.value, _WHAT[kind])


def _of_kind(kind: JobKind, states: type[P] | type[U]) -> dict[Any, frozenset[Any]]:
    """The one machine as one kind sees it, in that kind's own state names."""
    return {
        states(s.value): frozenset(states(t.value) for t in JOB_TRANSITIONS[s] & job_states(kind))
        for s in job_states(kind)
    }


PILOT_TRANSITIONS: dict[P, frozenset[P]] = _of_kind(JobKind.PILOT, P)
UNIT_TRANSITIONS: dict[U, frozenset[U]] = _of_kind(JobKind.UNIT, U)


def check_pilot_transition(pilot_id: str, current: P, target: P) -> None:
    check_job_transition(JobKind.PILOT, pilot_id, J(current.value), J(target.value))


def check_unit_transition(unit_id: str, current: U, target: U) -> None:
    check_job_transition(JobKind.UNIT, unit_id, J(current.value), J(target.value))
