"""Launching a plan's jobs, whatever their shape: CREATING rows and reservations first, then
one sbatch per job (a replica's, a pilot's, a PD unit's hetjob).

No partial launches: if any sbatch fails, the jobs this launch submitted are cancelled and every
replica of the launch is FAILED. An sbatch that fails may still have been accepted (killed at its
timeout, or Slurm's own "Socket timed out"): the job is then looked up by its tag and adopted, so
it is never left running without a row that records it.
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

from xhpc.broker.agents import hash_token
from xhpc.broker.lifecycle import Lifecycle
from xhpc.broker.plans import DeploymentPlan, JobKind, JobPlan, ReplicaPlan
from xhpc.broker.sweep import find_tagged
from xhpc.changes import ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import AgentSpec, PilotState, ReplicaState, Reservation, UnitState
from xhpc.records import JobRecord
from xhpc.render import SbatchParams
from xhpc.slurm.client import SlurmClient
from xhpc.states import FIRST_JOB_STATE, TERMINAL
from xhpc.store import DeploymentRow, JobRunRow, ReplicaRow, Store
from xhpc.store.cache import CacheLedger
from xhpc.store.jobs import Jobs
from xhpc.store.pilots import Pilots
from xhpc.store.units import Units

log = logging.getLogger(__name__)
S = ReplicaState
SCRIPT_FILE = "job.sbatch"
SECRET_FILE = "engine_secret"  # what xhpc.agent.agent reads
PILOT_SPEC = "pilot.json"  # what xhpc.agent.pilot reads
PARAMS_FILE = "sbatch.json"


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def submitted_job(
    job_id: str, replica_id: str, script: Path | None, output: str | None
) -> JobRunRow:
    """The jobs-table row of a job sbatch just accepted."""
    return JobRunRow(
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


def adopt_job(store: Store, lifecycle: Lifecycle, row: ReplicaRow, job_id: str, why: str) -> bool:
    """Record ``job_id`` as ``row``'s job, found rather than returned by sbatch: a CREATING row
    becomes QUEUED on it, a job of the replica's own gets its jobs-table row, and an event says
    why. False (nothing changed) when the row has ended meanwhile."""
    state = S(row.state)
    if state in TERMINAL:
        return False
    if row.pilot_id is None and row.pd_unit is None:
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


def _write_replica_dir(
    path: Path, spec: str, token: str, spec_name: str = "spec.json", secret: str | None = None
) -> None:
    """An owner-only directory with the agent's spec, its token and its engine's secret."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    write_private(path / spec_name, spec)
    write_private(path / "token", token)
    if secret is not None:
        write_private(path / SECRET_FILE, secret)


def _rows(
    replicas: Sequence[ReplicaPlan],
    deployment: str,
    engine: str,
    tokens: Mapping[str, str],
    engine_secrets: Mapping[str, str],
    now: datetime,
) -> list[ReplicaRow]:
    """The CREATING rows of planned replicas (only the hashes of their tokens)."""
    return [
        ReplicaRow(
            replica_id=r.replica_id,
            deployment=deployment,
            idx=r.index,
            state=S.CREATING.value,
            engine=engine,
            served_model=r.spec.served_model,
            token_hash=hash_token(tokens[r.replica_id]),
            replica_dir=str(r.replica_dir),
            placed_node=r.node if r.chosen else None,
            pinned=",".join(str(g) for g in r.gpu_idx),
            gpus_asked=r.sbatch.gpus,
            engine_secret=engine_secrets[r.replica_id],
            pd_role=r.spec.pd_role.value if r.spec.pd_role else None,
            created_at=now,
            updated_at=now,
        )
        for r in replicas
    ]


class Launcher:
    """The one launcher: every job shape is recorded, then submitted, here (submit-or-abort)."""

    def __init__(
        self, store: Store, slurm: SlurmClient, lifecycle: Lifecycle, user: str | None = None
    ) -> None:
        self.store = store
        self.pilots = Pilots(store)
        self.units = Units(store)
        self.jobs = Jobs(store)
        self.ledger = CacheLedger(store)
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.user = user if user is not None else current_user()

    async def launch(self, plan: DeploymentPlan, new_deployment: DeploymentRow | None) -> None:
        """Record ``plan`` (a new deployment, or more of an existing one), then submit its jobs.

        Every row (CREATING replicas, GPUs reserved, new pilots and units) is written before the
        first sbatch runs. No partial launch: if one sbatch fails, the jobs this launch submitted
        are cancelled and every replica of the launch is FAILED."""
        now = utcnow()
        tokens = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        engine_secrets = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        rows = _rows(plan.replicas, plan.name, plan.engine.value, tokens, engine_secrets, now)
        by_id = {row.replica_id: row for row in rows}
        for job in plan.jobs:
            for r in job.hosts:
                if job.kind is JobKind.PILOT:
                    by_id[r.replica_id].pilot_id = job.key
                elif job.kind is JobKind.UNIT:
                    by_id[r.replica_id].pd_unit = job.key
        reservations = [res for job in plan.jobs for res in _reservations(job, now)]
        if new_deployment is not None:
            self.store.create_deployment(new_deployment, rows, reservations)
        else:
            self.store.add_replicas(plan.name, rows, reservations)
        pilot_tokens = self._record_jobs(plan, now)
        for r in plan.replicas:
            _write_replica_dir(
                r.replica_dir,
                self._with_weights_digest(r.spec).model_dump_json(),
                tokens[r.replica_id],
                secret=engine_secrets[r.replica_id],
            )
        submitted: list[str] = []
        for job in plan.jobs:
            try:
                job_id = await self._submit(job, pilot_tokens.get(job.key))
            except SlurmError as err:
                await self._abort(plan, submitted, f"sbatch failed: {err.one_line()}")
                raise
            if job.submits and job_id is not None:
                submitted.append(job_id)
            self._queued(job, job_id)

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

    def _record_jobs(self, plan: DeploymentPlan, now: datetime) -> dict[str, str]:
        """The jobs-table rows of the plan's new pilots and units; each new pilot's token."""
        tokens: dict[str, str] = {}
        records: list[JobRecord] = []
        for job in plan.jobs:
            if job.kind is JobKind.PILOT and job.submits:
                tokens[job.key] = secrets.token_urlsafe(32)
                records.append(
                    JobRecord(
                        key=job.key,
                        kind=job.kind,
                        node=job.node,
                        gpus=job.gpus,
                        state=FIRST_JOB_STATE[job.kind],
                        token_hash=hash_token(tokens[job.key]),
                        job_dir=str(job.job_dir),
                        output_path=job.output,
                        created_at=now,
                        updated_at=now,
                    )
                )
            elif job.kind is JobKind.UNIT:
                records.append(
                    JobRecord(
                        key=job.key,
                        kind=job.kind,
                        deployment=plan.name,
                        index=job.index,
                        spec=str(plan.request.pd),
                        state=FIRST_JOB_STATE[job.kind],
                        job_dir=str(job.job_dir),
                        created_at=now,
                        updated_at=now,
                    )
                )
        self.jobs.add(records)
        return tokens

    async def _submit(self, job: JobPlan, pilot_token: str | None) -> str | None:
        """The job's id: sbatch of its script (found by its tag if sbatch failed but Slurm took
        it), or the live pilot's job that the replicas join."""
        if not job.submits:
            return self.pilots.get(job.key).job_id
        if job.kind is JobKind.REPLICA:
            job.job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        elif job.kind is JobKind.PILOT:
            assert job.spec is not None and pilot_token is not None
            _write_replica_dir(job.job_dir, job.spec, pilot_token, PILOT_SPEC)
        else:
            job.job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(job.job_dir, 0o700)
        script = job.job_dir / SCRIPT_FILE
        write_private(script, job.script)
        if job.params is not None:
            write_private(job.job_dir / PARAMS_FILE, job.params)
        job_id = await submit_tagged(self.slurm, script, job.tag, self.user)
        log.info("%s %s submitted as job %s", job.kind.value, job.key, job_id)
        return job_id

    def _queued(self, job: JobPlan, job_id: str | None) -> None:
        """Record the job's id on its rows: the replicas it hosts are QUEUED on it."""
        if job.kind is JobKind.REPLICA:
            assert job_id is not None
            (r,) = job.hosts
            script = job.job_dir / SCRIPT_FILE
            self.store.record_job(submitted_job(job_id, r.replica_id, script, job.output))
            why = f"submitted; {r.why}" if r.why else "submitted"
            self.store.transition(r.replica_id, S.QUEUED, why, ReplicaChange(job_id=job_id))
        elif job.kind is JobKind.PILOT:
            if job.submits:
                assert job_id is not None
                self.pilots.place(job.key, job_id)
            for r in job.hosts:
                self.store.transition(
                    r.replica_id, S.QUEUED, f"in pilot {job.key}", ReplicaChange(job_id=job_id)
                )
        else:
            assert job_id is not None
            self.units.place(job.key, job_id)
            for het, r in enumerate(job.hosts):
                msg = f"unit {job.key} submitted"
                self.store.transition(
                    r.replica_id, S.QUEUED, msg, ReplicaChange(job_id=f"{job_id}+{het}")
                )

    async def _abort(self, plan: DeploymentPlan, job_ids: Sequence[str], reason: str) -> None:
        await cancel_quietly(self.slurm, job_ids)
        for job in plan.jobs:
            if job.kind is JobKind.PILOT and job.submits:
                self.pilots.transition(job.key, PilotState.ENDED, reason)
            elif job.kind is JobKind.UNIT:
                self.units.transition(job.key, UnitState.ENDED, reason)
        for r in plan.replicas:
            self.lifecycle.move(self.store.replica(r.replica_id), S.FAILED, reason)


def _reservations(job: JobPlan, now: datetime) -> list[Reservation]:
    """The GPUs a job's launch books until Slurm shows them allocated: each replica's on its
    chosen node; a new pilot's, booked on its first replica (released like any other); none for
    replicas that join a live pilot (its GPUs are held already)."""
    if job.kind is JobKind.PILOT:
        if not job.submits or job.node is None or not job.hosts:
            return []
        first = job.hosts[0].replica_id
        return [Reservation(replica_id=first, node=job.node, gpus=job.gpus, created_at=now)]
    return [
        Reservation(replica_id=r.replica_id, node=r.node, gpus=r.sbatch.gpus, created_at=now)
        for r in job.hosts
        if r.node is not None
    ]
