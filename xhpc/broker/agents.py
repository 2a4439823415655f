"""The agent protocol: what in-job agents and node probes tell the broker, and its checks."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from xhpc.broker.lifecycle import Lifecycle
from xhpc.broker.probes import ProbeBook
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.models import AgentRegistration, AgentReport, ProbeReport, ReplicaState
from xhpc.store import ReplicaRow, Store

S = ReplicaState


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AgentDesk:
    def __init__(self, store: Store, lifecycle: Lifecycle, probes: ProbeBook) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.probes = probes

    def authenticate(self, replica_id: str, token: str) -> ReplicaRow:
        """The replica whose own token this is; PermissionError otherwise (constant time)."""
        try:
            row: ReplicaRow | None = self.store.replica(replica_id)
        except NotFoundError:
            row = None
        expected = row.token_hash if row and row.token_hash else hash_token(secrets.token_hex())
        if not hmac.compare_digest(expected, hash_token(token)) or row is None:
            raise PermissionError("bad agent token")
        return row

    def register(self, reg: AgentRegistration) -> None:
        row = self.store.replica(reg.replica_id)
        if row.job_id != reg.job_id:
            raise PermissionError("registration from a job that is not this replica's")
        self.lifecycle.move(
            row,
            S.READY,
            "engine answered",
            host=reg.host,
            port=reg.port,
            node=reg.node,
            gpus=",".join(str(g) for g in reg.gpus),
            served_model=reg.served_model,
            side_channel_port=reg.side_channel_port,
            last_heartbeat=utcnow(),
        )

    def report(self, rep: AgentReport) -> bool:
        """Returns False when the broker does not know this replica as registered."""
        row = self.store.replica(rep.replica_id)
        if row.job_id != rep.job_id:
            raise PermissionError("report from a job that is not this replica's")
        state = S(row.state)
        if rep.phase == "starting":
            self.lifecycle.move(row, S.STARTING, "job running")
        elif rep.phase == "ready":
            if state is S.LOST or row.host is None:
                return False
            self.store.update_replica(row.replica_id, last_heartbeat=utcnow())
        elif rep.phase == "stopping":
            self.lifecycle.move(row, S.DRAINING, rep.detail or "agent stopping")
        elif rep.phase == "stopped":  # a replica in a pilot: its engine is gone, the job runs on
            self.lifecycle.move(row, S.STOPPED, rep.detail or "stopped in its pilot")
        elif rep.phase == "failed":
            self.lifecycle.move(row, S.FAILED, rep.detail or "engine failed")
        return True

    def probe(self, token: str, report: ProbeReport) -> None:
        if not self.probes.authorized(token):
            raise PermissionError("bad node token")
        self.probes.put(report)
