"""The broker's logic: admission and submission, the agent protocol, and reconciliation."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from xhpc.broker.planner import DeploymentPlan, admission_problems, choose_engine, plan_deployment
from xhpc.broker.reconcile import Action, observe
from xhpc.catalog import resolve_model
from xhpc.clock import utcnow
from xhpc.errors import AdmissionError, NotFoundError, SlurmError, XhpcError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    DeploymentView,
    LogsView,
    NodeInfo,
    ReplicaState,
    ReplicaView,
    Route,
    RoutingTable,
    ServeRequest,
)
from xhpc.settings import XhpcConfig
from xhpc.slurm import SlurmClient
from xhpc.states import ACTIVE, can_transition
from xhpc.store import DeploymentRow, JobRow, ReplicaRow, Store, replica_view
from xhpc.store.store import dumps_args

log = logging.getLogger(__name__)
S = ReplicaState


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


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
    def __init__(self, config: XhpcConfig, store: Store, slurm: SlurmClient) -> None:
        self.config = config
        self.store = store
        self.slurm = slurm
        self.agent_python = sys.executable
        self._lock = asyncio.Lock()

    # -- serve ------------------------------------------------------------------------------
    async def plan(self, req: ServeRequest) -> DeploymentPlan:
        model = resolve_model(req.model, self.config, req.name)
        engine = choose_engine(req, model, self.config)
        nodes = await self.slurm.nodes()
        problems = admission_problems(req, nodes, self.config, engine)
        if problems:
            raise AdmissionError(problems)
        start = self.store.next_replica_index(model.name)
        return plan_deployment(
            req, model, self.config, start_index=start, agent_python=self.agent_python
        )

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
            # CREATING is written before the first sbatch runs.
            self.store.create_deployment(dep, rows)
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
            self.store.transition(r.replica_id, S.FAILED, reason)
        self.store.mark_deployment_stopped(plan.name)

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
                if state in (S.CREATING,) or r.job_id is None:
                    self.store.transition(r.replica_id, S.STOPPED, "stopped by user")
                    continue
                if state is not S.DRAINING:
                    self.store.transition(r.replica_id, S.DRAINING, "stopped by user")
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

    async def nodes(self) -> list[NodeInfo]:
        return await self.slurm.nodes()

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

    # -- agent protocol ---------------------------------------------------------------------
    def authenticate(self, replica_id: str, token: str) -> ReplicaRow:
        try:
            row = self.store.replica(replica_id)
        except NotFoundError:
            row = None
        expected = row.token_hash if row and row.token_hash else hash_token(secrets.token_hex())
        if not hmac.compare_digest(expected, hash_token(token)) or row is None:
            raise PermissionError("bad agent token")
        return row

    def _move(
        self, row: ReplicaRow, target: S, reason: str | None = None, **fields: object
    ) -> None:
        current = S(row.state)
        if current is target:
            if reason is not None:
                fields = {**fields, "reason": reason}
            if fields:
                self.store.update_replica(row.replica_id, **fields)
            return
        if current is S.QUEUED and target is S.READY:
            self.store.transition(row.replica_id, S.STARTING, "job running")
            current = S.STARTING
        if can_transition(current, target):
            self.store.transition(row.replica_id, target, reason, **fields)
        elif fields:
            self.store.update_replica(row.replica_id, **fields)

    def register(self, reg: AgentRegistration) -> None:
        row = self.store.replica(reg.replica_id)
        if row.job_id != reg.job_id:
            raise PermissionError("registration from a job that is not this replica's")
        self._move(
            row,
            S.READY,
            "engine answered",
            host=reg.host,
            port=reg.port,
            node=reg.node,
            gpus=",".join(str(g) for g in reg.gpus),
            served_model=reg.served_model,
            last_heartbeat=utcnow(),
        )

    def report(self, rep: AgentReport) -> bool:
        """Returns False when the broker does not know this replica as registered."""
        row = self.store.replica(rep.replica_id)
        if row.job_id != rep.job_id:
            raise PermissionError("report from a job that is not this replica's")
        state = S(row.state)
        if rep.phase == "starting":
            self._move(row, S.STARTING, "job running")
        elif rep.phase == "ready":
            if state is S.LOST or row.host is None:
                return False
            self.store.update_replica(row.replica_id, last_heartbeat=utcnow())
        elif rep.phase == "stopping":
            self._move(row, S.DRAINING, rep.detail or "agent stopping")
        elif rep.phase == "failed":
            self._move(row, S.FAILED, rep.detail or "engine failed")
        return True

    # -- reconcile --------------------------------------------------------------------------
    async def reconcile_once(self) -> int:
        """Compare SQLite with `squeue` and advance replica states. Returns actions applied."""
        rows = self.store.replicas(active_only=True)
        if not rows:
            return 0
        jobs = {j.job_id: j for j in await self.slurm.jobs()}
        stale = utcnow() - timedelta(seconds=self.config.broker.heartbeat_timeout_s)
        actions = observe(rows, jobs, stale_before=stale, now=utcnow())
        async with self._lock:
            for act in actions:
                self._apply(act)
        return len(actions)

    def _apply(self, act: Action) -> None:
        try:
            row = self.store.replica(act.replica_id)
            if act.job_update and row.job_id:
                self.store.update_job(row.job_id, **act.job_update)
            if act.target is not None:
                self._move(row, act.target, act.reason, **act.fields)
            elif act.fields:
                self.store.update_replica(row.replica_id, **act.fields)
            if act.target in (S.STOPPED, S.FAILED):
                self._maybe_close_deployment(row.deployment)
        except XhpcError as err:
            log.warning("reconcile: %s", err.one_line())

    def _maybe_close_deployment(self, name: str) -> None:
        if not any(S(r.state) in ACTIVE for r in self.store.replicas(deployment=name)):
            self.store.mark_deployment_stopped(name)
