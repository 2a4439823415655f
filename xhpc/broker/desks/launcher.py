"""Launching a plan's jobs, whatever their shape: CREATING rows and reservations first, then
one sbatch per job (a replica's, a pilot's, a PD unit's hetjob).

No partial launches: if any sbatch fails, the jobs this launch submitted are cancelled and every
replica of the launch is FAILED. An sbatch that fails may still have been accepted (killed at its
timeout, or Slurm's own "Socket timed out"): the job is then looked up by its tag and adopted, so
it is never left running without a row that records it.

There is one path for every kind of job: what differs per kind (its jobs-table row, the GPUs it
books, its directory, the ids its replicas record) is its shape's answer (xhpc.broker.admit.shapes).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from xhpc.broker.admit.shapes import (
    PARAMS_FILE,
    SCRIPT_FILE,
    Hosting,
    shape_hosting,
    shape_of,
    write_agent_dir,
    write_private,
)
from xhpc.broker.desks.agents import hash_token
from xhpc.broker.plan.plans import DeploymentPlan, JobPlan
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.sweep import find_tagged
from xhpc.changes import ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import AgentSpec, JobState, ReplicaState
from xhpc.records import DeploymentRecord, JobRunRecord, ReplicaRecord
from xhpc.render import SbatchParams
from xhpc.slurm.client import SlurmClient
from xhpc.states import TERMINAL
from xhpc.store import Store
from xhpc.store.cache import CacheLedger
from xhpc.store.jobs import Jobs

log = logging.getLogger(__name__)
S = ReplicaState


def submitted_job(
    job_id: str, replica_id: str, script: Path | None, output: str | None
) -> JobRunRecord:
    """The first run of a job sbatch just accepted."""
    return JobRunRecord(
        job_id=job_id,
        replica_id=replica_id,
        slurm_state="PENDING",
        script_path=str(script) if script is not None else None,
        output_path=output,
        submitted_at=utcnow(),
    )


def current_user() -> str:
    """The Unix user this broker runs as: the only user whose jobs it judges."""
    return pwd.getpwuid(os.getuid()).pw_name


def _output_of(replica_dir: Path) -> str | None:
    """The job output path the replica's sbatch script was rendered with, if it is known."""
    try:
        return SbatchParams.model_validate_json((replica_dir / PARAMS_FILE).read_text()).output
    except (OSError, ValueError):
        return None


def adopt_job(
    store: Store, lifecycle: Lifecycle, row: ReplicaRecord, job_id: str, why: str
) -> bool:
    """Record ``job_id`` as ``row``'s job, found rather than returned by sbatch: a CREATING row
    becomes QUEUED on it, a job of the replica's own gets its jobs-table row, and an event says
    why. False (nothing changed) when the row has ended meanwhile."""
    state = row.state
    if state in TERMINAL:
        return False
    if shape_hosting(Hosting(pilot=row.pilot, unit=row.unit)).own_runs:
        rdir = Path(row.replica_dir) if row.replica_dir else None
        script, output = (rdir / SCRIPT_FILE, _output_of(rdir)) if rdir else (None, None)
        store.record_job(submitted_job(job_id, row.replica_id, script, output))
    lifecycle.move(
        row, S.QUEUED if state is S.CREATING else state, why, ReplicaChange(job_id=job_id)
    )
    store.add_event(row.replica_id, row.deployment, "adopt", f"job {job_id}: {why}")
    return True


async def submit_tagged(slurm: SlurmClient, script: Path, tag: str, user: str | None) -> str:
    """sbatch ``script``; when sbatch fails, one squeue looks for a job tagged ``tag`` that
    Slurm accepted all the same: the oldest is taken as submitted, any other is cancelled.
    Raises the sbatch error when Slurm shows none (or cannot be asked)."""
    try:
        return await slurm.submit(script)
    except SlurmError as err:
        try:
            found = find_tagged(await slurm.jobs(), tag, user)
        except SlurmError as lookup:
            log.error(
                "submit action=lookup-failed tag=%s reason=%s",
                tag,
                json.dumps(f"{err.one_line()}; squeue: {lookup.one_line()}"),
            )
            raise err from None
        if not found:
            raise
        job_id, *extra = found
        log.warning(
            "submit action=adopt job=%s tag=%s reason=%s",
            job_id,
            tag,
            json.dumps(f"sbatch failed but Slurm accepted the job: {err.one_line()}"),
        )
        for other in extra:
            log.warning('submit action=cancel job=%s tag=%s reason="a second job"', other, tag)
        await cancel_quietly(slurm, extra)
        return job_id


async def cancel_quietly(slurm: SlurmClient, job_ids: Sequence[str]) -> bool:
    """scancel, logging (not raising) a failure: the caller's state change goes on."""
    if not job_ids:
        return True
    try:
        await slurm.cancel(job_ids)
    except SlurmError as err:
        log.error("could not cancel jobs %s: %s", list(job_ids), err.one_line())
        return False
    return True


def _records(
    plan: DeploymentPlan,
    tokens: Mapping[str, str],
    engine_secrets: Mapping[str, str],
    now: datetime,
) -> list[ReplicaRecord]:
    """The CREATING replicas of a plan, each in the job its shape hosts it in (only the hashes
    of their tokens)."""
    hosting = {r.replica_id: shape_of(job).hosting(job) for job in plan.jobs for r in job.hosts}
    return [
        ReplicaRecord(
            replica_id=r.replica_id,
            deployment=plan.name,
            index=r.index,
            state=S.CREATING,
            engine=plan.engine,
            served_model=r.spec.served_model,
            token_hash=hash_token(tokens[r.replica_id]),
            replica_dir=str(r.replica_dir),
            placed_node=r.node if r.chosen else None,
            pinned=tuple(r.gpu_idx),
            gpus_asked=r.sbatch.gpus,
            engine_secret=engine_secrets[r.replica_id],
            role=r.spec.pd_role,
            pilot=hosting[r.replica_id].pilot if r.replica_id in hosting else None,
            unit=hosting[r.replica_id].unit if r.replica_id in hosting else None,
            created_at=now,
            updated_at=now,
        )
        for r in plan.replicas
    ]


class Launcher:
    """The one launcher: every job shape is recorded, then submitted, here (submit-or-abort)."""

    def __init__(
        self, store: Store, slurm: SlurmClient, lifecycle: Lifecycle, user: str | None = None
    ) -> None:
        self.store = store
        self.jobs = Jobs(store)
        self.ledger = CacheLedger(store)
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.user = user if user is not None else current_user()

    async def launch(self, plan: DeploymentPlan, new_deployment: DeploymentRecord | None) -> None:
        """Record ``plan`` (a new deployment, or more of an existing one), then submit its jobs.

        Every row (CREATING replicas, GPUs reserved, new pilots and units) is written before the
        first sbatch runs. No partial launch: if one sbatch fails, the jobs this launch submitted
        are cancelled and every replica of the launch is FAILED."""
        now = utcnow()
        tokens = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        engine_secrets = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        rows = _records(plan, tokens, engine_secrets, now)
        reservations = [res for job in plan.jobs for res in shape_of(job).reservations(job, now)]
        if new_deployment is not None:
            self.store.create_deployment(new_deployment, rows, reservations)
        else:
            self.store.add_replicas(plan.name, rows, reservations)
        job_tokens, tabled = self._record_jobs(plan, now)
        for r in plan.replicas:
            write_agent_dir(
                r.replica_dir,
                self._with_weights_digest(r.spec).model_dump_json(),
                tokens[r.replica_id],
                secret=engine_secrets[r.replica_id],
            )
        submitted: list[str] = []
        for job in plan.jobs:
            try:
                job_id = await self._submit(job, job_tokens.get(job.key))
            except SlurmError as err:
                await self._abort(plan, tabled, submitted, f"sbatch failed: {err.one_line()}")
                raise
            if job.submits and job_id is not None:
                submitted.append(job_id)
            self._queued(job, job_id, job.key in tabled)

    def _with_weights_digest(self, spec: AgentSpec) -> AgentSpec:
        """``spec`` with the ledger's digest of the shared copy it stages from (when staging
        is on and the ledger knows that copy at that path): the agent then uses a node-local
        copy only if its content has that digest, whatever the node holds."""
        if spec.stage_dir is None:
            return spec
        shared = self.ledger.shared(spec.weights or spec.deployment)
        if shared is None or shared.path != spec.model_path:
            return spec
        return spec.model_copy(update={"weights_digest": shared.digest})

    def _record_jobs(self, plan: DeploymentPlan, now: datetime) -> tuple[dict[str, str], set[str]]:
        """The jobs-table rows of the plan's new jobs (of the kinds that have one). Returns the
        token of each job that runs an agent of its own, and the keys of the rows written."""
        tokens = {
            job.key: secrets.token_urlsafe(32)
            for job in plan.jobs
            if shape_of(job).needs_token(job)
        }
        hashes = {key: hash_token(token) for key, token in tokens.items()}
        records = [
            record
            for job in plan.jobs
            if (record := shape_of(job).record(job, plan, hashes.get(job.key), now)) is not None
        ]
        self.jobs.add(records)
        return tokens, {record.key for record in records}

    async def _submit(self, job: JobPlan, token: str | None) -> str | None:
        """The job's id: sbatch of its script (found by its tag if sbatch failed but Slurm took
        it), or, for a job with no script, the id of the live job its replicas join."""
        if not job.submits:
            return self.jobs.get(job.kind, job.key).job_id
        shape_of(job).prepare(job, token)
        script = job.job_dir / SCRIPT_FILE
        write_private(script, job.script)
        if job.params is not None:
            write_private(job.job_dir / PARAMS_FILE, job.params)
        job_id = await submit_tagged(self.slurm, script, job.tag, self.user)
        log.info("%s %s submitted as job %s", job.kind.value, job.key, job_id)
        return job_id

    def _queued(self, job: JobPlan, job_id: str | None, tabled: bool) -> None:
        """Record the job's id: on its row in the jobs table (if this launch wrote one), and on
        the replicas it hosts, QUEUED on it (with a run of their own job, if it is theirs)."""
        shape = shape_of(job)
        if tabled and job_id is not None:
            self.jobs.place(job.kind, job.key, job_id)
        for r, recorded in shape.replica_job_ids(job, job_id):
            if shape.own_runs and recorded is not None:
                run = submitted_job(recorded, r.replica_id, job.job_dir / SCRIPT_FILE, job.output)
                self.store.record_job(run)
            why = shape.queued_reason(job, r)
            self.store.transition(r.replica_id, S.QUEUED, why, ReplicaChange(job_id=recorded))

    async def _abort(
        self, plan: DeploymentPlan, tabled: set[str], job_ids: Sequence[str], reason: str
    ) -> None:
        await cancel_quietly(self.slurm, job_ids)
        for job in plan.jobs:
            if job.key in tabled:
                self.jobs.transition(job.kind, job.key, JobState.ENDED, reason)
        for r in plan.replicas:
            self.lifecycle.move(self.store.replica(r.replica_id), S.FAILED, reason)
