"""What ``GET /v1/overview`` sends: everything `xhpc top` draws of the broker's state in one
answer, built from the broker's shared Slurm view (no Slurm call of its own).

It reuses the wire types that exist: the nodes are ``SnapshotView`` (``GET /v1/nodes``), the
deployments ``DeploymentView`` (``GET /v1/deployments``, each with its active replicas only),
the events ``EventRecord``; per replica, what is coming for it is ``ReplicaOutlook`` (which
`xhpc ps` and `xhpc serve` get on each replica too, as ``ReplicaView.outlook``).
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from xhpc.models import DeploymentView, Frozen, ReplicaOutlook, ReplicaView
from xhpc.placement.views import SnapshotView
from xhpc.records import EventRecord

DEFAULT_EVENTS = 20
MAX_EVENTS = 200


class Overview(Frozen):
    taken_at: datetime
    slurm_age_s: float = Field(ge=0)  # age of the shared Slurm view it was built from
    nodes: SnapshotView
    deployments: tuple[DeploymentView, ...] = ()
    outlook: tuple[ReplicaOutlook, ...] = ()
    events: tuple[EventRecord, ...] = ()  # the most recent, oldest first
    proxies: int = 0  # proxy workers that synced with the broker in the last 10 s

    def replicas(self) -> list[ReplicaView]:
        return [r for d in self.deployments for r in d.replicas]

    def outlook_of(self) -> dict[str, ReplicaOutlook]:
        return {o.replica_id: o for o in self.outlook}
