"""The broker's PD front: admit, place and scale PD deployments by whole units. It plans behind
the service's one planning entry (``BrokerService.plan``), and its plans launch through the one
launcher like any other.

It works for the broker's service through ``PdHost``, the part of the service it uses (the
service hands itself in), so this module does not import the service that imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from xhpc.broker.desks.launcher import Launcher
from xhpc.broker.desks.unit_desk import UnitDesk
from xhpc.broker.plan.desired import stored_request
from xhpc.broker.plan.pd_planner import pd_admission_problems, plan_units, unit_roles
from xhpc.broker.plan.planner import choose_engine
from xhpc.broker.plan.plans import DeploymentPlan
from xhpc.broker.plan.units import role_gpus, role_nodes, role_pool
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.poller import SlurmPoller, SlurmView
from xhpc.catalog import resolve_model
from xhpc.clock import utcnow
from xhpc.engine_schemas import EngineSchemas
from xhpc.errors import AdmissionError
from xhpc.models import (
    NodeInfo,
    PdRole,
    ReplicaState,
    Reservation,
    ScaleResult,
    ServeRequest,
    UnitState,
)
from xhpc.placement import (
    ClusterSnapshot,
    Placement,
    PlacementError,
    PlacementRequest,
    Strategy,
    Topology,
    apply_reservations,
    arrays_for,
)
from xhpc.records import DeploymentRecord, ReplicaRecord
from xhpc.settings import XhpcConfig
from xhpc.store import Store

log = logging.getLogger(__name__)
S = ReplicaState


class PdHost(Protocol):
    """What the PD front uses of the broker's service (``xhpc.broker.service``)."""

    @property
    def config(self) -> XhpcConfig: ...

    @property
    def store(self) -> Store: ...

    @property
    def poller(self) -> SlurmPoller: ...

    @property
    def strategy(self) -> Strategy: ...

    @property
    def launcher(self) -> Launcher: ...

    @property
    def lifecycle(self) -> Lifecycle: ...

    @property
    def unit_desk(self) -> UnitDesk: ...

    @property
    def agent_python(self) -> str: ...

    @property
    def broker_id(self) -> str: ...

    @property
    def schemas(self) -> EngineSchemas: ...

    def start_drain(self, row: ReplicaRecord) -> None:
        """Drain the replica: cancel its job once its requests are done."""
        ...


class PdFront:
    """PD deployments for ``service``; ``snapshot`` is the cluster as placement sees it, from
    a Slurm view (the service's, with its reservations and probe reports)."""

    def __init__(self, service: PdHost, snapshot: Callable[[SlurmView], ClusterSnapshot]) -> None:
        self.svc = service
        self.snapshot = snapshot

    async def plan(self, req: ServeRequest, avoid: Sequence[str] = ()) -> DeploymentPlan:
        """Whole units of ``req``, admitted and placed (``avoid``: nodes that just failed one
        of its instances, used only where nothing else fits)."""
        svc = self.svc
        config = svc.config
        model = resolve_model(req.model, config, req.name)
        engine = choose_engine(req, model, config)
        view = await svc.poller.view(config.placement.max_view_age_s)
        partitions = await svc.poller.partitions()
        problems, pool = pd_admission_problems(
            req,
            view.nodes,
            config,
            engine,
            partitions,
            accounting=await svc.poller.accounting(),
            weights=str(model.path),
        )
        if not problems:
            ecfg, where = config.engine(engine), str(model.path)
            problems = await svc.schemas.problems(req.engine_config, engine, ecfg, where)
        if problems:
            raise AdmissionError(problems)
        placements: list[list[str | None]] = []
        if not req.let_slurm_place:
            # An instance across nodes keeps within a leaf switch where the site has a topology.
            spans = any(role_nodes(req, role) > 1 for role in PdRole)
            topology = await svc.poller.topology() if spans else None
            placements = self._place(self.snapshot(view), req, pool, topology, avoid)
        return plan_units(
            req,
            model,
            config,
            start_index=svc.unit_desk.units.next_index(model.name),
            agent_python=svc.agent_python,
            broker_id=svc.broker_id,
            placements=placements,
        )

    def _place(
        self,
        snap: ClusterSnapshot,
        req: ServeRequest,
        pool: list[NodeInfo],
        topology: Topology | None = None,
        avoid: Sequence[str] = (),
    ) -> list[list[str | None]]:
        """A node per component (a node set, comma-joined with its head first, when it spans
        nodes), idle-first; a unit's components always on different nodes (Slurm's rule for a
        hetjob; the KV transfer then really crosses the network), off ``avoid`` when anything
        else fits. None: nothing fits now (Slurm then chooses, as the nodes free up)."""
        pd = self.svc.config.pd
        partition = req.partition or self.svc.config.slurm.partition
        whole = self.svc.config.multi_node.whole_nodes
        out: list[list[str | None]] = []
        for _ in range(req.replicas):
            chosen: list[str | None] = []
            for role in unit_roles(req):
                gpus, span = role_gpus(req, role), role_nodes(req, role)
                hostlist = pd.prefill_nodes if role is PdRole.PREFILL else pd.decode_nodes
                allowed = [n.name for n in role_pool(pool, hostlist)]
                used = {n for c in chosen if c for n in c.split(",")}
                shape = PlacementRequest(
                    gpus=gpus,
                    replicas=1,
                    span=span,
                    whole=span > 1 and whole,
                    partition=partition,
                    gpu_type=req.gpu_type,
                )
                # Slurm never gives two components of a hetjob the same node (sbatch refuses
                # node lists that overlap): only nodes no other component has.
                free = [n for n in allowed if n not in used]
                placed = None
                for candidates in ([n for n in free if n not in avoid], free):
                    placed = placed or self._one(snap, shape, candidates, topology)
                chosen.append(",".join(placed.node_set or (placed.node,)) if placed else None)
                if placed is not None:
                    head, *also = placed.node_set or (placed.node,)
                    booked = Reservation(
                        replica_id="-",
                        node=head,
                        gpus=gpus,
                        created_at=utcnow(),
                        also=tuple(also),
                    )
                    snap = apply_reservations(snap, [booked])
            out.append(chosen)
        return out

    def _one(
        self,
        snap: ClusterSnapshot,
        shape: PlacementRequest,
        candidates: list[str],
        topology: Topology | None,
    ) -> Placement | None:
        known = set(arrays_for(snap).names)
        request = shape.model_copy(update={"nodes": tuple(n for n in candidates if n in known)})
        if not request.nodes:
            return None
        try:
            (placement,) = self.svc.strategy.place(snap, request, topology)
        except PlacementError:
            return None
        return placement

    async def add_units(self, dep: DeploymentRecord, count: int) -> tuple[str, ...]:
        plan = await self.plan(stored_request(dep, count))
        await self.svc.launcher.launch(plan, None)
        return tuple(r.replica_id for r in plan.replicas)

    async def scale(self, dep: DeploymentRecord, target: int, result: ScaleResult) -> ScaleResult:
        """Whole units only: a PD deployment is never resized in place."""
        desk = self.svc.unit_desk
        live = desk.units.of(dep.name, live_only=True)
        result = result.model_copy(update={"previous": len(live)})
        if target > len(live):
            return result.model_copy(
                update={"added": await self.add_units(dep, target - len(live))}
            )
        if target < len(live):
            # Units not serving yet go first, then the newest.
            ranked = sorted(live, key=lambda u: (u.state is UnitState.READY, -u.index))
            removed: list[str] = []
            for unit in ranked[: len(live) - target]:
                for row in desk.units.instances(unit.unit_id, active_only=True):
                    self.svc.lifecycle.move(row, S.DRAINING, "scaled down")
                    self.svc.start_drain(self.svc.store.replica(row.replica_id))
                    removed.append(row.replica_id)
                desk.units.transition(unit.unit_id, UnitState.STOPPING)
            return result.model_copy(update={"removed": tuple(removed)})
        return result
