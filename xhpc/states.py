"""The state machines of replicas, pilots and PD units: the only legal transitions."""

from __future__ import annotations

from xhpc.errors import StateTransitionError
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


# A pilot job: pending and running may alternate (Slurm requeues it); stopping only ends.
PILOT_TRANSITIONS: dict[P, frozenset[P]] = {
    P.PENDING: frozenset({P.RUNNING, P.STOPPING, P.ENDED}),
    P.RUNNING: frozenset({P.PENDING, P.STOPPING, P.ENDED}),
    P.STOPPING: frozenset({P.ENDED}),
    P.ENDED: frozenset(),
}

# A PD unit's state sums up its instances' (xhpc.broker.units): it moves freely among the
# live states, a unit being stopped only ends, and an ended one stays ended.
_LIVE_UNIT = frozenset({U.STARTING, U.READY, U.DEGRADED})
UNIT_TRANSITIONS: dict[U, frozenset[U]] = {
    **{u: (_LIVE_UNIT - {u}) | {U.STOPPING, U.ENDED} for u in _LIVE_UNIT},
    U.STOPPING: frozenset({U.ENDED}),
    U.ENDED: frozenset(),
}


def check_pilot_transition(pilot_id: str, current: P, target: P) -> None:
    if current is not target and target not in PILOT_TRANSITIONS[current]:
        raise StateTransitionError(pilot_id, current.value, target.value, "pilot")


def check_unit_transition(unit_id: str, current: U, target: U) -> None:
    if current is not target and target not in UNIT_TRANSITIONS[current]:
        raise StateTransitionError(unit_id, current.value, target.value, "PD unit")
