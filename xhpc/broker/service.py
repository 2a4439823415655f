"""The broker's logic: admission, placement and submission, stopping, reads, reconciliation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

from xhpc.broker.agents import AgentDesk, hash_token
from xhpc.broker.lifecycle import Lifecycle
from xhpc.broker.planner import DeploymentPlan, admission_problems, choose_engine, plan_deployment
from xhpc.broker.poller import SlurmPoller, SlurmView
from xhpc.broker.probes import ProbeBook
from xhpc.broker.reconcile import Action, observe
from xhpc.catalog import resolve_model
from xhpc.clock import utcnow
from xhpc.errors import AdmissionError, NotFoundError, SlurmError, XhpcError
from xhpc.models import (
    DeploymentView,
    JobInfo,
    LogsView,
    ReplicaState,
    ReplicaView,
    Reservation,
    Route,
    RoutingTable,
    ServeRequest,
)
from xhpc.placement import (
    HOLDING_STATES,
    ClusterSnapshot,
    PlacementRequest,
    build_snapshot,
    expand_hostlist,
    get_strategy,
)
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import DeploymentRow, JobRow, ReplicaRow, Store, replica_view
from xhpc.store.store import dumps_args

log = logging.getLogger(__name__)
S = ReplicaState


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _tail(path: Path, lines: int) -> str:
    try:
        data = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


class BrokerService:
    def __init__(
        self, config: XhpcConfig, store: Store, slurm: SlurmClient, probes: ProbeBook | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.slurm = slurm
        self.poller = SlurmPoller(slurm)
        self.lifecycle = Lifecycle(store)
        self.probes = probes or ProbeBook(secrets.token_urlsafe(32))
        self.agents = AgentDesk(store, self.lifecycle, self.probes)
        self.strategy = get_strategy(config.placement.strategy)
        self.agent_python = sys.executable
        self._lock = asyncio.Lock()

    # -- serve ------------------------------------------------------------------------------
    async def plan(self, req: ServeRequest) -> DeploymentPlan:
        model = resolve_model(req.model, self.config, req.name)
        engine = choose_engine(req, model, self.config)
        view = await self.poller.view(self.config.placement.max_view_age_s)
        problems = admission_problems(req, list(view.nodes), self.config, engine)
        if problems:
            raise AdmissionError(problems)
        placements: list[str | None] = []
        if not req.let_slurm_place:
            # Advisory: Slurm's allocation stays authoritative (it picks the GPU indexes).
            chosen = self.strategy.place(self._snapshot(view), self._placement_request(req))
            placements = [p.node for p in sorted(chosen, key=lambda p: p.replica)]
        start = self.store.next_replica_index(model.name)
        return plan_deployment(
            req,
            model,
            self.config,
            start_index=start,
            agent_python=self.agent_python,
            placements=placements,
        )

    def _placement_request(self, req: ServeRequest) -> PlacementRequest:
        return PlacementRequest(
            gpus=req.gpus,
            replicas=req.replicas,
            partition=req.partition or self.config.slurm.partition,
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
        return build_snapshot(
            view.nodes,
            view.jobs,
            reservations,
            self.probes.reports(),
            now=utcnow(),
            probe_ttl_s=self.config.placement.probe_ttl_s,
            sinfo_at=taken,
            squeue_at=taken,
        )

    async def snapshot(self) -> ClusterSnapshot:
        return self._snapshot(await self.poller.view(self.config.placement.max_view_age_s))

    async def serve(self, req: ServeRequest) -> DeploymentView:
        async with self._lock:
            plan = await self.plan(req)
            now = utcnow()
            dep = DeploymentRow(
                name=plan.name,
                model=req.model,
                model_path=str(plan.model.path),
                engine=plan.engine.value,
                gpus=req.gpus,
                partition=req.partition,
                time_limit=req.time,
                nodelist=req.nodelist,
                engine_args=dumps_args(req.engine_args),
                created_at=now,
            )
            tokens = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
            rows = [
                ReplicaRow(
                    replica_id=r.replica_id,
                    deployment=plan.name,
                    idx=r.index,
                    state=S.CREATING.value,
                    engine=plan.engine.value,
                    served_model=r.spec.served_model,
                    token_hash=hash_token(tokens[r.replica_id]),
                    replica_dir=str(r.replica_dir),
                    created_at=now,
                    updated_at=now,
                )
                for r in plan.replicas
            ]
            reservations = [
                Reservation(replica_id=r.replica_id, node=r.node, gpus=req.gpus, created_at=now)
                for r in plan.replicas
                if r.node is not None
            ]
            # CREATING and the reservations are written before the first sbatch runs.
            self.store.create_deployment(dep, rows, reservations)
            await self._submit_all(plan, tokens)
            return self.store.deployment_view(plan.name)

    async def _submit_all(self, plan: DeploymentPlan, tokens: dict[str, str]) -> None:
        submitted: list[str] = []
        for r in plan.replicas:
            r.replica_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(r.replica_dir, 0o700)
            _write_private(r.replica_dir / "spec.json", r.spec.model_dump_json(indent=2))
            _write_private(r.replica_dir / "token", tokens[r.replica_id])
            script = r.replica_dir / "job.sbatch"
            _write_private(script, r.script)
            try:
                job_id = await self.slurm.submit(script)
            except SlurmError as err:
                await self._abort(plan, submitted, f"sbatch failed: {err.one_line()}")
                raise
            submitted.append(job_id)
            self.store.record_job(
                JobRow(
                    job_id=job_id,
                    replica_id=r.replica_id,
                    slurm_state="PENDING",
                    script_path=str(script),
                    output_path=r.sbatch.output,
                    submitted_at=utcnow(),
                )
            )
            self.store.transition(r.replica_id, S.QUEUED, "submitted", job_id=job_id)
            log.info("replica %s submitted as job %s", r.replica_id, job_id)

    async def _abort(self, plan: DeploymentPlan, job_ids: Sequence[str], reason: str) -> None:
        """No partial deployments: cancel what this request submitted, fail every replica."""
        if job_ids:
            try:
                await self.slurm.cancel(job_ids)
            except SlurmError as err:
                log.error("could not cancel jobs %s: %s", job_ids, err.one_line())
        for r in plan.replicas:
            self.lifecycle.move(self.store.replica(r.replica_id), S.FAILED, reason)

    # -- stop -------------------------------------------------------------------------------
    async def stop(self, target: str) -> list[ReplicaView]:
        async with self._lock:
            rows = [
                r
                for r in self.store.replicas(active_only=True)
                if target in (r.deployment, r.replica_id)
            ]
            if not rows:
                known = [r.replica_id for r in self.store.replicas(deployment=target)]
                if known or self._deployment_exists(target):
                    return [replica_view(r) for r in self.store.replicas(deployment=target)]
                raise NotFoundError(f"no deployment or replica named {target!r}")
            jobs: list[str] = []
            for r in rows:
                state = S(r.state)
                if state is S.CREATING or r.job_id is None:
                    self.lifecycle.move(r, S.STOPPED, "stopped by user")
                    continue
                self.lifecycle.move(r, S.DRAINING, "stopped by user")
                jobs.append(r.job_id)
            if jobs:
                await self.slurm.cancel(jobs)
            return [replica_view(self.store.replica(r.replica_id)) for r in rows]

    def _deployment_exists(self, name: str) -> bool:
        try:
            self.store.get_deployment(name)
        except NotFoundError:
            return False
        return True

    # -- reads ------------------------------------------------------------------------------
    def replicas(self, all_: bool = False) -> list[ReplicaView]:
        return [replica_view(r) for r in self.store.replicas(active_only=not all_)]

    def deployment(self, name: str) -> DeploymentView:
        return self.store.deployment_view(name)

    def routes(self) -> RoutingTable:
        rows = self.store.replicas(active_only=True)
        models = sorted({r.deployment for r in rows if S(r.state) is not S.DRAINING})
        routes = tuple(
            Route(
                model=r.deployment,
                replica_id=r.replica_id,
                url=f"http://{r.host}:{r.port}",
                served_model=r.served_model or r.deployment,
            )
            for r in rows
            if S(r.state) is S.READY and r.host and r.port
        )
        table = RoutingTable(models=tuple(models), routes=routes)
        # A content digest: equal tables have equal versions, across broker restarts too.
        digest = hashlib.sha256(table.model_dump_json().encode()).hexdigest()
        return table.model_copy(update={"version": int(digest[:8], 16)})

    def logs(self, replica_id: str, lines: int = 200) -> LogsView:
        row = self.store.replica(replica_id)
        out = ""
        engine_log = ""
        if row.job_id:
            job = self.store.job(row.job_id)
            if job and job.output_path:
                out = _tail(Path(job.output_path.replace("%j", row.job_id)), lines)
            if row.replica_dir:
                engine_log = _tail(Path(row.replica_dir) / f"engine-{row.job_id}.log", lines)
        return LogsView(replica_id=replica_id, job_output=out, engine_log=engine_log)

    # -- reconcile --------------------------------------------------------------------------
    async def reconcile_once(self) -> int:
        """Poll Slurm (the shared view), advance replica states, settle reservations.

        Returns the number of actions applied."""
        view = await self.poller.view(max_age_s=0.0)
        jobs = {j.job_id: j for j in view.jobs}
        rows = self.store.replicas(active_only=True)
        stale = utcnow() - timedelta(seconds=self.config.broker.heartbeat_timeout_s)
        actions = observe(rows, jobs, stale_before=stale, now=utcnow())
        async with self._lock:
            for act in actions:
                self._apply(act)
            self._settle_reservations(rows, jobs)
        return len(actions)

    def _apply(self, act: Action) -> None:
        try:
            row = self.store.replica(act.replica_id)
            if act.job_update and row.job_id:
                self.store.update_job(row.job_id, **act.job_update)
            if act.target is not None:
                self.lifecycle.move(row, act.target, act.reason, **act.fields)
            elif act.fields:
                self.store.update_replica(row.replica_id, **act.fields)
        except XhpcError as err:
            log.warning("reconcile: %s", err.one_line())

    def _settle_reservations(self, rows: Sequence[ReplicaRow], jobs: Mapping[str, JobInfo]) -> None:
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
