"""``GET /v1/overview`` (`xhpc top`): the nodes, deployments, replicas, proxy load and recent
events in one answer, from what the broker already holds: the shared Slurm view (polled at most
once per interval, however many dashboards ask), the store, and the proxies' sync reports.

``replica_outlook`` is pure: what is coming for each replica of one deployment (Slurm's pending
reason and start estimate, its job's time left, the walltime handover the keeper will start, the
requests in flight to it, its engine's queue and KV-cache use at the broker's last scrape).
``with_outlook`` puts it on the replicas `xhpc ps` and `xhpc serve` get, from the latest Slurm
view the broker holds (never a Slurm call of its own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from xhpc.broker.admit.members import members
from xhpc.broker.desks.unit_desk import with_het_ids
from xhpc.broker.plan.continuity import LIVE, handover_lead
from xhpc.broker.watch.engine_metrics import EngineLoad
from xhpc.broker.watch.lifecycle import this_serving
from xhpc.clock import utcnow
from xhpc.dashboard.overview import Overview
from xhpc.models import JobInfo, ReplicaOutlook, ReplicaState, ReplicaView, RestartPolicy
from xhpc.records import DeploymentRecord
from xhpc.settings import LifecycleConfig
from xhpc.states import ACTIVE

if TYPE_CHECKING:
    from xhpc.broker.service import BrokerService

S = ReplicaState


def replica_outlook(
    dep: DeploymentRecord,
    views: Sequence[ReplicaView],
    jobs: Mapping[str, JobInfo],
    in_flight: Mapping[str, int],
    cfg: LifecycleConfig,
    now: datetime,
    engines: Mapping[str, EngineLoad] | None = None,
) -> list[ReplicaOutlook]:
    """One outlook per active replica of ``dep`` (``views``: all of its replicas, history
    included: the handover lead is measured on its recent starts, as the keeper does) at
    ``now``; ``engines``: the engines' own figures, by replica (recent scrapes only)."""
    engines = engines or {}
    serving = this_serving(dep, views)
    kept = dep.stopped_at is None and dep.failed_reason is None and dep.wanted > 0
    handing = kept and dep.restart is not RestartPolicy.NEVER
    lead = handover_lead(members(serving, by_unit=dep.pd is not None), cfg)
    # A PD unit's successor names the unit it replaces; a replica's, the replica.
    successor = {
        r.successor_of: r.replica_id for r in serving if r.successor_of and r.state in LIVE
    }
    out: list[ReplicaOutlook] = []
    for r in views:
        if r.state not in ACTIVE:
            continue
        job = jobs.get(r.job_id or "")
        pending = job is not None and job.state == "PENDING"
        estimate = job.start_time if job is not None and pending else None
        succ = successor.get(r.unit or r.replica_id)
        due: datetime | None = None
        if handing and succ is None and r.state is S.READY and r.ends_at is not None:
            due = r.ends_at - lead
        load = engines.get(r.replica_id)
        out.append(
            ReplicaOutlook(
                replica_id=r.replica_id,
                in_flight=in_flight.get(r.replica_id, 0),
                pending_reason=job.reason if job is not None and pending else None,
                start_estimate=estimate,
                time_left_s=(
                    max(0.0, (r.ends_at - now).total_seconds()) if r.ends_at is not None else None
                ),
                handover_at=due,
                successor=succ,
                node_set=_node_set(job),
                engine_running=None if load is None else round(load.running),
                engine_waiting=None if load is None else round(load.waiting),
                kv_use=None if load is None or load.kv_use is None else _unit(load.kv_use),
            )
        )
    return out


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def _node_set(job: JobInfo | None) -> str | None:
    """The nodes of a running job over more than one node (its Slurm hostlist), else None."""
    if job is None or job.state != "RUNNING" or not job.nodes:
        return None
    return job.nodes if ("," in job.nodes or "[" in job.nodes) else None


async def overview(svc: BrokerService, events: int) -> Overview:
    """The overview now; ``events``: how many of the most recent events it carries."""
    view = await svc.poller.view(svc.config.placement.max_view_age_s)
    snapshot = await svc.snapshot(view)
    jobs = with_het_ids({j.job_id: j for j in view.jobs})
    in_flight = svc.drains.in_flight()
    engines = {rid: s.load for rid, s in svc.autoscaler.engines.fresh().items()}
    deployments = []
    outlook: list[ReplicaOutlook] = []
    for dep in svc.store.deployments():
        if dep.stopped_at is not None and dep.failed_reason is None:
            continue  # ended by its owner: `xhpc ps --all` has its history
        shown = svc.store.deployment_view(dep.name)
        outlook += replica_outlook(
            dep, shown.replicas, jobs, in_flight, svc.config.lifecycle, utcnow(), engines
        )
        active = tuple(r for r in shown.replicas if r.state in ACTIVE)
        deployments.append(shown.model_copy(update={"replicas": active}))
    return Overview(
        taken_at=utcnow(),
        slurm_age_s=max(0.0, view.age_s()),
        nodes=snapshot.view(),
        deployments=tuple(deployments),
        outlook=tuple(outlook),
        events=tuple(svc.store.events(limit=events)),
        proxies=svc.drains.proxies_heard(),
    )


def with_outlook(svc: BrokerService, views: Sequence[ReplicaView]) -> list[ReplicaView]:
    """``views`` with each active replica's outlook (``ReplicaView.outlook``), from the latest
    Slurm view the broker holds (none yet: no queue estimate, the rest still)."""
    latest = svc.poller.latest()
    jobs = with_het_ids({j.job_id: j for j in latest.jobs}) if latest is not None else {}
    in_flight = svc.drains.in_flight()
    engines = {rid: s.load for rid, s in svc.autoscaler.engines.fresh().items()}
    now = utcnow()
    found: dict[str, ReplicaOutlook] = {}
    cfg = svc.config.lifecycle
    for name in sorted({v.deployment for v in views if v.state in ACTIVE}):
        dep = svc.store.get_deployment(name)
        history = svc.store.deployment_view(name).replicas
        for o in replica_outlook(dep, history, jobs, in_flight, cfg, now, engines):
            found[o.replica_id] = o
    return [
        v.model_copy(update={"outlook": found[v.replica_id]}) if v.replica_id in found else v
        for v in views
    ]
