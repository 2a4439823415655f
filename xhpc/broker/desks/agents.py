"""The agent protocol: what in-job agents and node probes tell the broker, and its checks."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from enum import StrEnum

from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.probes import ProbeBook
from xhpc.changes import NO_CHANGE, ReplicaChange, heartbeat
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.models import AgentRegistration, AgentReport, ProbeReport, ReplicaState
from xhpc.records import ReplicaRecord
from xhpc.store import Store

S = ReplicaState
ENDED = frozenset({S.STOPPED, S.FAILED})


class Verdict(StrEnum):
    """The broker's answer to an agent: go on, register again, or stop (the replica is over,
    or the agent belongs to an earlier run of a requeued job)."""

    OK = "ok"
    REGISTER = "register again"
    GONE = "gone"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AgentDesk:
    def __init__(self, store: Store, lifecycle: Lifecycle, probes: ProbeBook) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.probes = probes

    def authenticate(self, replica_id: str, token: str) -> ReplicaRecord:
        """The replica whose own token this is; PermissionError otherwise (constant time)."""
        try:
            row: ReplicaRecord | None = self.store.replica(replica_id)
        except NotFoundError:
            row = None
        expected = row.token_hash if row and row.token_hash else hash_token(secrets.token_hex())
        if not hmac.compare_digest(expected, hash_token(token)) or row is None:
            raise PermissionError("bad agent token")
        return row

    def register(self, reg: AgentRegistration) -> Verdict:
        row = self.store.replica(reg.replica_id)
        if row.job_id != reg.job_id:
            raise PermissionError("registration from a job that is not this replica's")
        if _gone(row, reg.restarts):
            return Verdict.GONE
        now = utcnow()
        self.lifecycle.move(
            row,
            S.READY,
            "engine answered",
            ReplicaChange(
                host=reg.host,
                port=reg.port,
                node=reg.node,
                gpus=tuple(reg.gpus),
                served_model=reg.served_model,
                side_channel_port=reg.side_channel_port,
                max_model_len=reg.max_model_len,
                agent_port=reg.agent_port,
                last_heartbeat=now,
                ready_at=row.ready_at or now,
            ),
        )
        return Verdict.OK

    def report(self, rep: AgentReport) -> Verdict:
        row = self.store.replica(rep.replica_id)
        if row.job_id != rep.job_id:
            raise PermissionError("report from a job that is not this replica's")
        state = row.state
        if rep.restarts < row.restarts:
            return Verdict.GONE  # an earlier run of a requeued job: nothing it says is news
        if _gone(row, rep.restarts) and rep.phase in ("starting", "ready", "draining"):
            return Verdict.GONE
        if rep.phase == "starting":
            self.lifecycle.move(row, S.STARTING, "job running")
        elif rep.phase == "ready":
            if state is S.DRAINING:
                self.store.update_replica(row.replica_id, heartbeat(utcnow()))
                return Verdict.OK  # leaving: nothing to register again
            if state is not S.READY or row.host is None:
                return Verdict.REGISTER
            self.store.update_replica(row.replica_id, heartbeat(utcnow()))
        elif rep.phase == "draining":
            # The job's time limit is near. With another replica READY to take its traffic it
            # drains now (in-flight requests finish, then the broker cancels the job); alone,
            # it serves to the end rather than leave the model with nothing (its successor, if
            # one is starting, retires it the moment it is READY).
            others = [
                r
                for r in self.store.replicas(deployment=row.deployment, active_only=True)
                if r.replica_id != row.replica_id and r.state is S.READY and r.host
            ]
            if row.unit is not None:
                # A unit is one job: it is retired whole by its successor, else serves to the end.
                others = []
            if state is S.READY and not others:
                note = "time limit near; serving to the end (no other replica READY)"
                if (row.reason or "").startswith("handover:"):
                    note = row.reason or note  # the keeper's note says more: keep it
                self.store.update_replica(row.replica_id, heartbeat(utcnow(), note))
            else:
                self.lifecycle.move(row, S.DRAINING, rep.detail or "time limit near")
        elif rep.phase == "stopping":
            # SIGTERM reached the job: xhpc's own cancel (the row is DRAINING already), or Slurm
            # requeueing, preempting or ending it. Out of the routing table now; what the job
            # does next (PENDING again, or ended) decides the state.
            if state is S.DRAINING:
                self.lifecycle.move(row, S.DRAINING, rep.detail or "agent stopping")
            else:
                reason = rep.detail or "agent stopping"
                self.store.update_replica(
                    row.replica_id, ReplicaChange(host=None, port=None, reason=reason)
                )
        elif rep.phase == "stopped":  # a replica in a pilot: its engine is gone, the job runs on
            if state is S.DRAINING:  # xhpc had the pilot stop it
                self.lifecycle.move(row, S.STOPPED, rep.detail or "stopped in its pilot")
            else:
                # The pilot stopped it on its own: its job got SIGTERM or the time-limit
                # warning (an end, or a requeue). Out of the routing table now; the pilot job's
                # fate decides the state, as for a replica's own job.
                reason = rep.detail or "stopped by its pilot"
                self.store.update_replica(
                    row.replica_id, ReplicaChange(host=None, port=None, reason=reason)
                )
        elif rep.phase == "failed":
            # A replica across nodes names the node whose rank it lost: its replacement then
            # keeps away from that node (the keeper's cooldown reads a failed replica's node).
            lost = ReplicaChange(node=rep.node) if rep.node else NO_CHANGE
            self.lifecycle.move(row, S.FAILED, rep.detail or "engine failed", lost)
        return Verdict.OK

    def unreachable(self, replica_ids: Sequence[str]) -> list[ReplicaRecord]:
        """A proxy could not connect to these replicas (refused, timed out): a READY one leaves
        every proxy's routing table now (LOST), instead of after its heartbeats go stale. Its
        agent, if alive, is told to register again at its next heartbeat (READY again). PD
        instances are left to their unit (a LOST instance ends its whole unit). Returns the
        rows it made LOST, as they were (with their address)."""
        lost: list[ReplicaRecord] = []
        for rid in replica_ids:
            try:
                row = self.store.replica(rid)
            except NotFoundError:
                continue
            if row.state is S.READY and row.unit is None:
                self.lifecycle.move(row, S.LOST, "a proxy could not connect to it")
                lost.append(row)
        return lost

    def probe(self, token: str, report: ProbeReport) -> None:
        if not self.probes.authorized(token):
            raise PermissionError("bad node token")
        self.probes.put(report)


def _gone(row: ReplicaRecord, restarts: int) -> bool:
    """The replica is over, or the agent runs in an earlier run of its requeued job."""
    return row.state in ENDED or restarts < row.restarts
