"""Typed changes the broker asks the store to make (foundation): the store takes these, never
``**fields``.

A change names only what it sets: a field left out is left as the row has it (pydantic's
``model_fields_set`` says which were given), so ``ReplicaChange(host=None, port=None)`` clears an
address and ``ReplicaChange()`` changes nothing. Values are domain values (GPU indexes as tuples,
aware datetimes); the store turns them into columns. A state change is not a field: it goes
through the store's ``transition``, which checks it against the state machine (xhpc.states).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Self

from xhpc.models import Frozen


class Change(Frozen):
    """The base of every change: what it sets, and two changes as one."""

    def given(self) -> dict[str, Any]:
        """The fields this change sets, by name (an unset field is not among them)."""
        return {name: getattr(self, name) for name in sorted(self.model_fields_set)}

    def then(self, later: Self) -> Self:
        """This change followed by ``later`` (``later`` wins where both set a field)."""
        return self.model_copy(update=later.given())

    def __bool__(self) -> bool:
        return bool(self.model_fields_set)


class ReplicaChange(Change):
    """What a replica's row may be told besides its state: where its job placed it, where its
    engine answers, when its agent was last heard, which run of its job it expects."""

    job_id: str | None = None  # another job (a re-plan, an adoption): its run count starts over
    node: str | None = None
    gpus: tuple[int, ...] = ()
    host: str | None = None
    port: int | None = None
    served_model: str | None = None
    side_channel_port: int | None = None
    max_model_len: int | None = None
    agent_port: int | None = None
    last_heartbeat: datetime | None = None
    ready_at: datetime | None = None
    ends_at: datetime | None = None
    restarts: int = 0
    reason: str | None = None
    successor_of: str | None = None
    placed_node: str | None = None
    replans: int = 0


NO_CHANGE = ReplicaChange()
# Off the node: its address, heartbeat and end belong to the job that is gone.
OFF_NODE = ReplicaChange(host=None, port=None, last_heartbeat=None, ends_at=None)


def heartbeat(at: datetime, reason: str | None = None) -> ReplicaChange:
    """Its agent was heard at ``at`` (with a note, when one is given)."""
    if reason is None:
        return ReplicaChange(last_heartbeat=at)
    return ReplicaChange(last_heartbeat=at, reason=reason)


class JobRunChange(Change):
    """What Slurm said of one run of a replica's job (its row in the runs table)."""

    slurm_state: str = ""
    reason: str | None = None
    node: str | None = None
    gres_detail: str | None = None
    ended_at: datetime | None = None


NO_RUN_CHANGE = JobRunChange()


class DeploymentChange(Change):
    """The desired state of a deployment as the broker changes it."""

    wanted: int = 0
    failed_reason: str | None = None
    sleeping: bool = False
    request: str | None = None  # the stored request (JSON): a policy changed in place
