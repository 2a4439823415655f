"""The broker's logic: admission, placement and submission, stopping, reads, reconciliation."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path

from xhpc.access import Caller, KeyCreate, KeyCreated, check_owner
from xhpc.broker.admit.key_identity import check_key_identity
from xhpc.broker.batches.batch_desk import BatchDesk
from xhpc.broker.desks.adapter_desk import AdapterDesk
from xhpc.broker.desks.agents import AgentDesk
from xhpc.broker.desks.autoscale_desk import AutoscaleDesk
from xhpc.broker.desks.cache_desk import CacheDesk
from xhpc.broker.desks.launcher import Launcher, cancel_quietly
from xhpc.broker.desks.lost_jobs import LostJobs
from xhpc.broker.desks.orphan_desk import OrphanDesk
from xhpc.broker.desks.pd_front import PdFront
from xhpc.broker.desks.pilot_desk import PilotDesk
from xhpc.broker.desks.proxy_desk import ProxyDesk
from xhpc.broker.desks.replanner import Replanner
from xhpc.broker.desks.sweep_desk import SweepDesk
from xhpc.broker.desks.unit_desk import UnitDesk, leader, with_het_ids
from xhpc.broker.desks.usage_desk import UsageDesk
from xhpc.broker.keeper import Keeper
from xhpc.broker.metrics import BrokerMetrics
from xhpc.broker.outlook import with_outlook
from xhpc.broker.plan import queue_estimates
from xhpc.broker.plan.desired import policy_of, served_deployment, stopping, stored_request
from xhpc.broker.plan.pilots import pilot_problems, pinned_to_pilot
from xhpc.broker.plan.planner import (
    DeploymentPlan,
    JobPlan,
    admission_problems,
    choose_engine,
    join_pilot,
    plan_deployment,
    plan_pilot,
)
from xhpc.broker.plan.scaling import check_scalable, counted, pick_removals
from xhpc.broker.watch.drain import DrainBook
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.poller import SlurmPoller, SlurmView
from xhpc.broker.watch.probes import ProbeBook
from xhpc.broker.watch.reconcile import Action, observe
from xhpc.broker.watch.replica_logs import logs_view
from xhpc.catalog import resolve_model
from xhpc.changes import DeploymentChange
from xhpc.clock import monotonic, utcnow
from xhpc.engine_schemas import EngineSchemas
from xhpc.errors import AdmissionError, NotFoundError, ValidationError, XhpcError
from xhpc.models import (
    DeploymentView,
    JobInfo,
    LogsView,
    ReplicaState,
    ReplicaView,
    RoutingTable,
    ScaleResult,
    ServeRequest,
)
from xhpc.orphans import OrphanFixRequest, OrphanFixResult, OrphanReport
from xhpc.placement import (
    HOLDING_STATES,
    ClusterSnapshot,
    Placement,
    PlacementError,
    PlacementRequest,
    SnapshotBuilder,
    Topology,
    arrays_for,
    expand_hostlist,
    get_strategy,
)
from xhpc.records import ReplicaRecord
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store
from xhpc.store.keys import Keys

log = logging.getLogger(__name__)
S = ReplicaState
SWEEP_INTERVAL_S = 15.0  # under CREATING_GRACE minus the sweep's grace (xhpc.broker.watch.sweep)


def broker_id(state_dir: Path) -> str:
    """This state directory's broker id (made once): it tags the jobs this broker submits."""
    path = state_dir / "broker-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        state_dir.mkdir(parents=True, exist_ok=True)
        value = secrets.token_hex(4)
        path.write_text(value + "\n")
        return value


def not_started(row: ReplicaRecord) -> bool:
    """Nothing runs for it yet: no job, or a pilot that has not started it (a pilot stops only
    the replicas it runs): stopping it is immediate, there is nothing to drain."""
    state = row.state
    return (
        state is S.CREATING or row.job_id is None or (row.pilot is not None and state is S.QUEUED)
    )


def _log_reasons(chosen: Sequence[Placement]) -> None:
    for p in chosen:
        log.info("placement of replica %d: %s", p.replica, p.reason)


class BrokerService:
    def __init__(
        self, config: XhpcConfig, store: Store, slurm: SlurmClient, probes: ProbeBook | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.slurm = slurm
        self.metrics = BrokerMetrics()  # the broker's own (GET /v1/metrics)
        self.poller = SlurmPoller(slurm)
        self.schemas = EngineSchemas()  # the engines' own argument schemas, read when needed
        self.snapshots = SnapshotBuilder()  # keeps per-node values between polls' snapshots
        self.lifecycle = Lifecycle(store, self.metrics)
        self.probes = probes or ProbeBook(secrets.token_urlsafe(32))
        self.agents = AgentDesk(store, self.lifecycle, self.probes)
        self.strategy = get_strategy(config.placement.strategy)
        self.launcher = Launcher(store, slurm, self.lifecycle)
        self.drains = DrainBook()
        self.broker_id = config.broker.id or broker_id(config.resolved_state_dir)
        self.orphan_desk = OrphanDesk(
            config, store, slurm, self.poller, self.probes, self.lifecycle, self.broker_id
        )
        self.replanner = Replanner(
            config, store, slurm, self.strategy, self._snapshot, self.metrics
        )
        self.pilot_desk = PilotDesk(store, slurm, config.autoscale.pilot_warm_s)
        self.unit_desk = UnitDesk(store, slurm, self.lifecycle)
        self.unit_desk.drain = self.start_drain
        self.pd = PdFront(self, self._snapshot)
        self.keys = Keys(store)
        self.adapter_desk = AdapterDesk(store)
        self._lock = asyncio.Lock()
        self.autoscaler = AutoscaleDesk(self, self._lock)
        self.proxies = ProxyDesk(
            store, self.unit_desk, self.drains, self.keys, self.adapter_desk, self.autoscaler
        )
        self._draining: dict[str, asyncio.Task[None]] = {}
        self.agent_python = sys.executable
        self.cache = CacheDesk(config, store, slurm, self.broker_id, self.agent_python)
        self.keeper = Keeper(self)
        self.lost_jobs = LostJobs(store, self.lifecycle, self.replanner, self.poller, self._lock)
        # Jobs found by their tag: adopted or cancelled, at start-up and then on a timer.
        self.sweep_desk = SweepDesk(store, slurm, self.lifecycle, self.broker_id)
        self.batches = BatchDesk(
            config, slurm, self.broker_id, self.launcher.user, self.routes,
            self.proxies.access, self.store.live_deployment, self.keys.add_usage,
        )  # fmt: skip
        self.usage_desk = UsageDesk(
            store, self.keys, slurm, self.poller, self.launcher.user, self.batches.charges
        )
        self._swept_at: float | None = None
        # Heartbeats are not judged until agents have had time to find a restarted broker.
        self.started_at = utcnow()

    # -- serve ------------------------------------------------------------------------------
    async def plan(
        self, req: ServeRequest, avoid: Sequence[str] = (), not_into: str | None = None
    ) -> DeploymentPlan:
        """The one planning entry, for every kind of job: serve, scale, the keeper's
        replacements and successors, and dry runs all plan here. A PD request is planned by
        whole units (its admission and placement are the PD front's). ``avoid``: nodes that
        just failed a replica; ``not_into``: a pilot whose job ends soon (a successor of its
        replicas goes into a new pilot)."""
        if req.pd is not None:
            return await self.pd.plan(req, avoid)
        model = resolve_model(req.model, self.config, req.name)
        engine = choose_engine(req, model, self.config)
        view = await self.poller.view(self.config.placement.max_view_age_s)
        sharing = self.config.placement.gpu_sharing
        pilot = self.pilot_desk.live_on(req.pilot, exclude=not_into) if req.pilot else None
        problems = admission_problems(
            pinned_to_pilot(req),
            list(view.nodes),
            self.config,
            engine,
            await self.poller.partitions(),
            accounting=await self.poller.accounting(),
            gpu_sharing=sharing,
            pilot=req.pilot is not None,
            weights=str(model.path),
        )
        node = next((n for n in view.nodes if n.name == req.pilot), None)
        problems += pilot_problems(req, node, pilot, gpu_sharing=sharing)
        if not problems:
            ecfg, where = self.config.engine(engine), str(model.path)
            problems = await self.schemas.problems(req.engine_config, engine, ecfg, where)
        if problems:
            raise AdmissionError(problems)
        placements: list[str | None] = []
        snap = None
        if not req.let_slurm_place and req.pilot is None:
            # Advisory: Slurm's allocation stays authoritative (it picks the GPU indexes).
            snap = self._snapshot(view)
            # A replica across nodes keeps within a leaf switch where the site has a topology.
            topology = await self.poller.topology() if req.nodes > 1 else None
            preq = self._placement_request(req, model.weights_key)
            placements = self._place(snap, preq, avoid, topology)
        job: JobPlan | None = None
        if pilot is not None:
            job = join_pilot(pilot.pilot_id, self.config, self.broker_id)
        elif req.pilot is not None:
            job = plan_pilot(
                self.pilot_desk.pilots.next_id(),
                req.pilot,
                req.pilot_gpus or (node.gpus_total if node else 1),
                self.config,
                broker_id=self.broker_id,
                agent_python=self.agent_python,
                partition=req.partition,
                time=req.time,
                gpu_type=req.gpu_type,
            )
        start = self.store.next_replica_index(model.name)
        build = partial(
            plan_deployment,
            pinned_to_pilot(req),
            model,
            self.config,
            start_index=start,
            agent_python=self.agent_python,
            broker_id=self.broker_id,
            pilot=job,
        )
        plan = build(placements=placements)
        if snap is None:
            return plan
        # Nothing idle for some: queue each where Slurm expects it to start first.
        preq = self._placement_request(req, model.weights_key)
        queued = await queue_estimates.for_plan(self.slurm, snap, preq, plan, self.config.placement)
        return plan if queued is None else build(placements=queued.nodes, reasons=queued.reasons)

    def _place(
        self,
        snap: ClusterSnapshot,
        preq: PlacementRequest,
        avoid: Sequence[str] = (),
        topology: Topology | None = None,
    ) -> list[str | None]:
        """A node per replica where GPUs are free now; replicas that fit nowhere now get None:
        they are submitted without a node of xhpc's choosing and wait in Slurm's queue (with
        Slurm's pending reason), as any job on a full cluster does. Nodes in ``avoid`` (they
        just failed a replica) are left out while other nodes fit."""
        if avoid:
            allowed = preq.nodes or tuple(arrays_for(snap).names)
            others = tuple(n for n in allowed if n not in set(avoid))
            if others:
                try:
                    only = preq.model_copy(update={"nodes": others})
                    chosen = self.strategy.place(snap, only, topology)
                    _log_reasons(chosen)
                    return [",".join(p.nodes) for p in sorted(chosen, key=lambda p: p.replica)]
                except PlacementError:
                    pass  # nowhere else fits now: the usual choice, avoided nodes included
        try:
            chosen = self.strategy.place(snap, preq, topology)
        except PlacementError as err:
            fits = preq.model_copy(update={"replicas": err.fitted})
            chosen = self.strategy.place(snap, fits, topology) if err.fitted else []
            log.info(
                "%d of %d replica(s) fit nowhere now: Slurm queues them",
                preq.replicas - err.fitted,
                preq.replicas,
            )
        _log_reasons(chosen)
        # a replica across nodes: its node set, head first, as a Slurm hostlist
        nodes: list[str | None] = [
            ",".join(p.nodes) for p in sorted(chosen, key=lambda p: p.replica)
        ]
        return nodes + [None] * (preq.replicas - len(nodes))

    def _placement_request(self, req: ServeRequest, model: str) -> PlacementRequest:
        """What to place; ``model``'s node-local copies (the weights cache) break ties."""
        return PlacementRequest(
            model=model,
            local_nodes=self.cache.holders(model),
            gpus=req.gpus,
            replicas=req.replicas,
            span=req.nodes,
            whole=req.nodes > 1 and self.config.multi_node.whole_nodes,
            partition=req.partition or self.config.slurm.partition,
            gpu_type=req.gpu_type,
            nodes=expand_hostlist(req.nodelist),
        )

    def _snapshot(self, view: SlurmView) -> ClusterSnapshot:
        """Slurm's view, minus the GPUs promised to replicas Slurm has not allocated yet."""
        holding = {j.job_id for j in view.jobs if j.state in HOLDING_STATES}
        job_of = {r.replica_id: r.job_id for r in self.store.replicas(active_only=True)}
        # A reservation whose job Slurm already shows holding its GPUs would count twice.
        reservations = [
            r for r in self.store.open_reservations() if job_of.get(r.replica_id) not in holding
        ]
        taken = utcnow() - timedelta(seconds=view.age_s())
        return self.snapshots.build(
            view.nodes,
            view.jobs,
            reservations,
            self.probes.reports(),
            now=utcnow(),
            probe_ttl_s=self.config.placement.probe_ttl_s,
            sinfo_at=taken,
            squeue_at=taken,
        )

    async def snapshot(self, view: SlurmView | None = None) -> ClusterSnapshot:
        """The cluster snapshot of ``view`` (default: the shared view, polled if too old)."""
        if view is None:
            view = await self.poller.view(self.config.placement.max_view_age_s)
        return self._snapshot(view)

    async def serve(self, req: ServeRequest, caller: Caller | None = None) -> DeploymentView:
        async with self._lock:
            plan = await self.plan(req)
            owner = caller.user if caller is not None else None
            path = str(plan.model.path)
            dep = served_deployment(req, plan.name, path, plan.engine, owner, self.config)
            await self.launcher.launch(plan, dep)
            return self.store.deployment_view(plan.name)

    # -- scale ------------------------------------------------------------------------------
    async def scale(self, name: str, target: int, caller: Caller | None = None) -> ScaleResult:
        """Add replicas (ids continue after the highest ever used) or drain the least loaded
        ones before cancelling their jobs. Scaling to the current count changes nothing."""
        async with self._lock:
            dep = self.store.get_deployment(name)
            check_owner(caller, dep.owner, f"deployment {name!r}")
            active = self.store.replicas(deployment=name, active_only=True)
            rows = {r.replica_id: r for r in active}
            views = active
            check_scalable(dep, views, target)
            policy = policy_of(dep)
            # Autoscaled, at zero and not asleep: stopped (an autoscaler's pass begun before).
            if policy is not None and stopping(dep) and target > 0:
                raise ValidationError(f"deployment {name!r} is being stopped")
            if policy is not None and caller is not None:
                raise ValidationError(
                    f"deployment {name!r} is autoscaled ({policy.shown()}): the broker sets its "
                    "replica count",
                    hint=f"`xhpc scale {name} --min A --max B` changes its policy",
                )
            live = counted(views)
            result = ScaleResult(deployment=name, previous=len(live), target=target)
            sleeping = policy is not None and target == 0  # its policy's: a call wakes it
            self.store.update_deployment(name, DeploymentChange(wanted=target, sleeping=sleeping))
            if dep.pd is not None:
                return await self.pd.scale(dep, target, result)
            if target > len(live):
                plan = await self.plan(stored_request(dep, target - len(live)))
                await self.launcher.launch(plan, None)
                return result.model_copy(
                    update={"added": tuple(r.replica_id for r in plan.replicas)}
                )
            if target < len(live):
                victims = pick_removals(live, len(live) - target, self.drains.outstanding)
                for victim in victims:
                    row = rows[victim.replica_id]
                    if not_started(row):
                        self.lifecycle.move(row, S.STOPPED, "scaled down")
                    else:
                        self.lifecycle.move(row, S.DRAINING, "scaled down")
                        self.start_drain(row)
                return result.model_copy(update={"removed": tuple(r.replica_id for r in victims)})
            return result

    def start_drain(self, row: ReplicaRecord) -> None:
        replica_id = row.replica_id
        if replica_id in self._draining or row.job_id is None:
            return
        task = asyncio.create_task(self._finish_drain(replica_id, row.job_id, row.pilot, row.unit))
        self._draining[replica_id] = task
        task.add_done_callback(lambda _t: self._draining.pop(replica_id, None))

    async def _finish_drain(
        self, replica_id: str, job_id: str, pilot_id: str | None, unit: str | None = None
    ) -> None:
        """Cancel the job (or have the pilot stop the replica) once no proxy routes to the
        replica or has a request in flight to it, or after the drain timeout. A PD instance's
        job is its whole unit's: it is cancelled once every instance of the unit is drained."""
        deadline = monotonic() + self.config.broker.drain_timeout_s
        ids = [replica_id]
        if unit is not None:
            ids += [r.replica_id for r in self.unit_desk.units.instances(unit, active_only=True)]
        while not all(self.drains.drained(i) for i in ids) and monotonic() < deadline:
            await asyncio.sleep(0.2)
        if pilot_id is not None:
            log.info("replica %s drained; pilot %s stops it", replica_id, pilot_id)
            self.pilot_desk.release(replica_id)
            return
        log.info("replica %s drained; cancelling job %s", replica_id, job_id)
        await cancel_quietly(self.slurm, [leader(job_id)])  # a PD instance: its whole unit

    # -- stop -------------------------------------------------------------------------------
    async def stop(self, target: str, caller: Caller | None = None) -> list[ReplicaView]:
        """Stop a deployment (it wants no replica any more) or one replica (it wants one
        fewer: the keeper does not replace it)."""
        async with self._lock:
            rows = [
                r
                for r in self.store.replicas(active_only=True)
                if target in (r.deployment, r.replica_id)
            ]
            deps = sorted({r.deployment for r in rows} | self._live_deployment(target))
            for dep in deps:
                check_owner(caller, self.store.get_deployment(dep).owner, f"deployment {dep!r}")
            if not rows and not deps:
                known = [r.replica_id for r in self.store.replicas(deployment=target)]
                if known or self._deployment_exists(target):
                    return [r.view() for r in self.store.replicas(deployment=target)]
                raise NotFoundError(f"no deployment or replica named {target!r}")
            for dep in deps:
                if dep == target:  # stopped whole: not asleep either
                    self.store.update_deployment(dep, DeploymentChange(wanted=0, sleeping=False))
                    continue
                wanted = self.store.get_deployment(dep).wanted - len(rows)
                self.store.update_deployment(dep, DeploymentChange(wanted=max(0, wanted)))
            await self._stop_rows(rows, "stopped by user")
            for dep in deps:
                self.lifecycle.close_if_done(dep)
            return [self.store.replica(r.replica_id).view() for r in rows]

    async def stop_deployment(self, name: str, reason: str) -> None:
        """The broker's own stop (a deployment's time is up, or it failed); under the lock."""
        self.store.update_deployment(name, DeploymentChange(wanted=0, sleeping=False))
        await self._stop_rows(self.store.replicas(deployment=name, active_only=True), reason)
        self.lifecycle.close_if_done(name)

    async def _stop_rows(self, rows: Sequence[ReplicaRecord], reason: str) -> None:
        jobs: list[str] = []
        for r in rows:
            if not_started(r) or r.job_id is None:
                self.lifecycle.move(r, S.STOPPED, reason)
                continue
            self.lifecycle.move(r, S.DRAINING, reason)
            if r.pilot is not None:
                self.pilot_desk.release(r.replica_id)  # the pilot job serves others
            elif leader(r.job_id) not in jobs:
                jobs.append(leader(r.job_id))  # a PD instance ends its whole unit
        await self.cancel_jobs(jobs)

    async def cancel_jobs(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            await self.slurm.cancel(job_ids)

    def _live_deployment(self, name: str) -> set[str]:
        try:
            dep = self.store.get_deployment(name)
        except NotFoundError:
            return set()
        return {name} if dep.stopped_at is None else set()

    def _deployment_exists(self, name: str) -> bool:
        try:
            self.store.get_deployment(name)
        except NotFoundError:
            return False
        return True

    # -- reads ------------------------------------------------------------------------------
    def replicas(self, all_: bool = False) -> list[ReplicaView]:
        views = [r.view() for r in self.store.replicas(active_only=not all_)]
        return with_outlook(self, views)

    def deployment(self, name: str) -> DeploymentView:
        view = self.store.deployment_view(name)
        view = view.model_copy(update={"replicas": tuple(with_outlook(self, view.replicas))})
        ready = [r.replica_id for r in view.replicas if r.state is S.READY and r.unit is None]
        if ready and not self.drains.routed(ready):
            return view.model_copy(update={"routed": False})
        return view

    def deployments(self) -> list[DeploymentView]:
        """Live deployments, and those the broker gave up on (their reason shows in `ps`)."""
        return [
            self.store.deployment_view(d.name)
            for d in self.store.deployments()
            if d.stopped_at is None or d.failed_reason is not None
        ]

    def routes(self) -> RoutingTable:
        return self.proxies.routes()

    async def create_key(self, req: KeyCreate) -> KeyCreated:
        """A key for a Unix user, charged to one of its Slurm accounts
        (xhpc.broker.admit.key_identity); refused before anything is stored when Slurm's
        identity says no."""
        accounting = await self.poller.accounting(strict=True)
        warning = await check_key_identity(req, self.slurm, accounting)
        view, key = self.keys.create(req)
        if warning:
            log.warning("key %s for %s: %s", view.key_id, view.user, warning)
        await self.proxies.grants_reach_proxies(monotonic())
        return KeyCreated(view=view, key=key, warning=warning)

    def _log_files(self, replica_id: str, caller: Caller | None) -> tuple[Path | None, Path | None]:
        """A replica's job output and engine log files (they may hold prompts: its owner's
        only), or None where it has none."""
        row = self.store.replica(replica_id)
        check_owner(
            caller, self.store.get_deployment(row.deployment).owner, f"replica {replica_id!r}"
        )
        out: Path | None = None
        engine_log: Path | None = None
        if row.job_id:
            job = self.store.job(row.replica_id, row.job_id)
            output = job.output_path if job else None
            if row.pilot is not None:
                output = self.pilot_desk.pilots.get(row.pilot).output_path
            if output:
                out = Path(output.replace("%j", row.job_id))
            if row.replica_dir:
                engine_log = Path(row.replica_dir) / f"engine-{row.job_id}.log"
        return out, engine_log

    def logs(self, replica_id: str, lines: int = 200, caller: Caller | None = None) -> LogsView:
        """The end of a replica's job output and engine log: ``lines`` lines at most, from the
        last LOG_TAIL_BYTES of each file however large it grew."""
        return logs_view(replica_id, *self._log_files(replica_id, caller), lines)

    async def tail_logs(
        self, replica_id: str, lines: int = 200, caller: Caller | None = None
    ) -> LogsView:
        """``logs`` for the event loop: the store is read here, the files in a thread."""
        out, engine_log = self._log_files(replica_id, caller)
        return await asyncio.to_thread(logs_view, replica_id, out, engine_log, lines)

    # -- orphans ----------------------------------------------------------------------------
    async def orphans(self, max_age_s: float | None = None) -> OrphanReport:
        return await self.orphan_desk.report(max_age_s)

    async def fix_orphans(self, req: OrphanFixRequest) -> OrphanFixResult:
        """Under the serve lock: a launch in flight (job submitted, row not updated yet) is
        never taken for an orphan."""
        async with self._lock:
            return await self.orphan_desk.fix(req)

    # -- reconcile --------------------------------------------------------------------------
    async def reconcile_once(self) -> int:
        """Poll Slurm (the shared view), advance replica states, settle reservations.

        Returns the number of actions applied."""
        view = await self.poller.view(max_age_s=0.0)
        # Before the rows are read (a job without a row is judged on this squeue) and before
        # observe (a CREATING row whose sbatch went through is adopted, not failed).
        if self._swept_at is None or monotonic() - self._swept_at >= SWEEP_INTERVAL_S:
            async with self._lock:
                await self.sweep_desk.run(view.jobs)
            self._swept_at = monotonic()
        jobs = with_het_ids({j.job_id: j for j in view.jobs})
        rows = self.store.replicas(active_only=True)
        now = utcnow()
        timeout = timedelta(seconds=self.config.broker.heartbeat_timeout_s)
        grace = timedelta(seconds=self.config.lifecycle.restart_grace_s)
        # Just after a (re)start, saved heartbeats are old: agents get time to report again.
        stale = now - timeout if now - self.started_at > timeout + grace else None
        actions = observe(rows, jobs, stale_before=stale, now=now)
        async with self._lock:
            for act in actions:
                self._apply(act)
            self._settle_reservations(rows, jobs)
            self._resume_drains(rows, jobs)
            await self.replanner.run(view, self.store.replicas(active_only=True))
            await self.pilot_desk.reconcile(jobs)
            await self.unit_desk.reconcile()
            await self.keeper.run()
        self.adapter_desk.kick(self.store.replicas(active_only=True))
        await self.autoscaler.run()
        await self.batches.refresh(view.jobs)
        await self.cache.pulls.refresh(view.jobs)
        return len(actions)

    def _apply(self, act: Action) -> None:
        try:
            row = self.store.replica(act.replica_id)
            if act.job_id is not None and row.job_id != act.job_id:
                return  # decided on a job the replica has left since (moved under the lock)
            if act.job_update and row.job_id:
                self.store.update_job(row.replica_id, row.job_id, act.job_update)
            if act.target is not None:
                self.lifecycle.move(row, act.target, act.reason, act.change)
            elif act.change:
                self.store.update_replica(row.replica_id, act.change)
        except XhpcError as err:
            log.warning("reconcile: %s", err.one_line())

    def _resume_drains(self, rows: Sequence[ReplicaRecord], jobs: Mapping[str, JobInfo]) -> None:
        """A DRAINING replica whose job still runs gets its drain finished (after a restart)."""
        for row in rows:
            job = jobs.get(row.job_id or "")
            if row.state is S.DRAINING and job is not None and job.state == "RUNNING":
                self.start_drain(row)

    def _settle_reservations(
        self, rows: Sequence[ReplicaRecord], jobs: Mapping[str, JobInfo]
    ) -> None:
        """Release a reservation once Slurm's view shows the job holding its GPUs, or when it
        has waited longer than the site allows (then the job competes like any other)."""
        job_of = {r.replica_id: r.job_id for r in rows}
        timeout = timedelta(seconds=self.config.placement.reservation_timeout_s)
        now = utcnow()
        for res in self.store.open_reservations():
            job = jobs.get(job_of.get(res.replica_id) or "")
            if job is not None and job.state in HOLDING_STATES:
                self.store.release_reservation(res.replica_id, "allocated")
            elif now - res.created_at > timeout:
                self.store.release_reservation(res.replica_id, "timeout")
