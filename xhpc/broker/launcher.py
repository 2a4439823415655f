"""Launching planned replicas: CREATING rows and reservations first, then one sbatch each.

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
from xhpc.broker.planner import DeploymentPlan, ReplicaPlan
from xhpc.broker.sweep import find_tagged
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import PilotState, ReplicaState, Reservation
from xhpc.render import SbatchParams
from xhpc.slurm.client import SlurmClient
from xhpc.states import TERMINAL
from xhpc.store import DeploymentRow, JobRow, ReplicaRow, Store
from xhpc.store.pilots import Pilots
from xhpc.store.tables import PilotRow

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


def submitted_job(job_id: str, replica_id: str, script: Path | None, output: str | None) -> JobRow:
    """The jobs-table row of a job sbatch just accepted."""
    return JobRow(
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
    lifecycle.move(row, S.QUEUED if state is S.CREATING else state, why, job_id=job_id)
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
    def __init__(
        self, store: Store, slurm: SlurmClient, lifecycle: Lifecycle, user: str | None = None
    ) -> None:
        self.store = store
        self.pilots = Pilots(store)
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.user = user if user is not None else current_user()

    async def launch(self, plan: DeploymentPlan, new_deployment: DeploymentRow | None) -> None:
        """Record and submit ``plan``'s replicas: a new deployment, or more of an existing one."""
        now = utcnow()
        tokens = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        engine_secrets = {r.replica_id: secrets.token_urlsafe(32) for r in plan.replicas}
        pilot_token = secrets.token_urlsafe(32)
        rows = _rows(plan.replicas, plan.name, plan.engine.value, tokens, engine_secrets, now)
        for row in rows:
            row.pilot_id = plan.pilot_id
        reservations = [
            Reservation(replica_id=r.replica_id, node=r.node, gpus=r.sbatch.gpus, created_at=now)
            for r in plan.replicas
            if r.node is not None and plan.pilot_id is None
        ]
        if plan.new_pilot is not None:
            # The pilot's GPUs, booked on its first replica (released like any other).
            p = plan.new_pilot
            first = plan.replicas[0].replica_id
            reservations = [Reservation(replica_id=first, node=p.node, gpus=p.gpus, created_at=now)]
        # CREATING and the reservations are written before the first sbatch runs.
        if new_deployment is not None:
            self.store.create_deployment(new_deployment, rows, reservations)
        else:
            self.store.add_replicas(plan.name, rows, reservations)
        if plan.new_pilot is not None:
            p = plan.new_pilot
            self.pilots.add(
                PilotRow(
                    pilot_id=p.pilot_id,
                    node=p.node,
                    gpus=p.gpus,
                    state=PilotState.PENDING.value,
                    token_hash=hash_token(pilot_token),
                    pilot_dir=str(p.pilot_dir),
                    output_path=p.sbatch.output,
                    created_at=now,
                    updated_at=now,
                )
            )
        for r in plan.replicas:
            _write_replica_dir(
                r.replica_dir,
                r.spec.model_dump_json(),
                tokens[r.replica_id],
                secret=engine_secrets[r.replica_id],
            )
        if plan.pilot_id is not None:
            await self._into_pilot(plan, pilot_token)
        else:
            await self._submit_all(plan)

    async def _into_pilot(self, plan: DeploymentPlan, token: str) -> None:
        """Replicas that run inside a pilot: their files, the pilot's job if it is new, and
        QUEUED on the pilot's job (the pilot agent picks them up at its next heartbeat)."""
        assert plan.pilot_id is not None
        p = plan.new_pilot
        if p is not None:
            _write_replica_dir(p.pilot_dir, p.spec.model_dump_json(indent=2), token, PILOT_SPEC)
            script = p.pilot_dir / SCRIPT_FILE
            write_private(script, p.script)
            try:
                job_id = await submit_tagged(self.slurm, script, p.sbatch.comment, self.user)
            except SlurmError as err:
                self.pilots.update(p.pilot_id, state=PilotState.ENDED.value, reason="sbatch failed")
                await self._abort(plan, [], f"sbatch failed: {err.one_line()}")
                raise
            self.pilots.update(p.pilot_id, job_id=job_id)
            log.info("pilot %s on %s submitted as job %s", p.pilot_id, p.node, job_id)
        pilot = self.pilots.get(plan.pilot_id)
        for r in plan.replicas:
            self.store.transition(
                r.replica_id, S.QUEUED, f"in pilot {pilot.pilot_id}", job_id=pilot.job_id
            )

    async def _submit_all(self, plan: DeploymentPlan) -> None:
        submitted: list[str] = []
        for r in plan.replicas:
            script = r.replica_dir / SCRIPT_FILE
            write_private(script, r.script)
            # What the script was rendered from: a re-plan renders it again for another node.
            write_private(r.replica_dir / PARAMS_FILE, r.sbatch.model_dump_json(indent=2))
            try:
                job_id = await submit_tagged(self.slurm, script, r.sbatch.comment, self.user)
            except SlurmError as err:
                await self._abort(plan, submitted, f"sbatch failed: {err.one_line()}")
                raise
            submitted.append(job_id)
            self.store.record_job(submitted_job(job_id, r.replica_id, script, r.sbatch.output))
            self.store.transition(r.replica_id, S.QUEUED, "submitted", job_id=job_id)
            log.info("replica %s submitted as job %s", r.replica_id, job_id)

    async def _abort(self, plan: DeploymentPlan, job_ids: Sequence[str], reason: str) -> None:
        await cancel_quietly(self.slurm, job_ids)
        for r in plan.replicas:
            self.lifecycle.move(self.store.replica(r.replica_id), S.FAILED, reason)
