"""Job shapes: what differs between the kinds of Slurm job a plan holds, as a few hooks.

Every kind of job goes through one launcher path (xhpc.broker.desks.launcher): its row in the jobs
table (if the kind has one), the GPUs it books, its owner-only directory, the ids its replicas
record once it is submitted. A kind is a small shape that answers those questions; the launcher
never asks which kind a job is.

- ``replica``: one job, one replica. No row of its own in the jobs table: its replica records
  each run of the job (``job_runs``). Its replica books its GPUs on its node.
- ``pilot``: one job holding a node's GPUs, its own agent (with a token) running the replicas it
  is given. A plan that joins a live pilot submits nothing and books nothing.
- ``unit``: one heterogeneous job; component N is the Nth hosted replica, which records
  ``JOB+N``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from xhpc.broker.plan.plans import DeploymentPlan, JobPlan, ReplicaPlan
from xhpc.models import JobKind, Reservation
from xhpc.records import JobRecord
from xhpc.states import FIRST_JOB_STATE

SCRIPT_FILE = "job.sbatch"
SECRET_FILE = "engine_secret"  # what xhpc.agent.agent reads
PILOT_SPEC = "pilot.json"  # what xhpc.agent.pilot reads
PARAMS_FILE = "sbatch.json"


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def private_dir(path: Path) -> None:
    """An owner-only directory (made so if it existed with a wider mode)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def write_agent_dir(
    path: Path, spec: str, token: str, spec_name: str = "spec.json", secret: str | None = None
) -> None:
    """An owner-only directory with an agent's spec, its token and its engine's secret."""
    private_dir(path)
    write_private(path / spec_name, spec)
    write_private(path / "token", token)
    if secret is not None:
        write_private(path / SECRET_FILE, secret)


@dataclass(frozen=True)
class Hosting:
    """What a hosted replica's row records of the job that hosts it (None: its own job)."""

    pilot: str | None = None
    unit: str | None = None


class KindShape:
    """The default shape: one job per replica, each replica booking its GPUs on its node. (Not
    the site policy's ``JobShape``: that one is what a job asks of Slurm, this one how xhpc
    records and launches a kind of job.)"""

    kind = JobKind.REPLICA
    # Its replicas record each run of the job (``job_runs``): the job is theirs alone.
    own_runs = True

    def hosting(self, job: JobPlan) -> Hosting:
        return Hosting()

    def needs_token(self, job: JobPlan) -> bool:
        """Does the job run an agent of its own, authenticated by a token of its own?"""
        return False

    def record(
        self, job: JobPlan, plan: DeploymentPlan, token_hash: str | None, now: datetime
    ) -> JobRecord | None:
        """The job's row in the jobs table (None: it has none, or it exists already), with the
        digest of its agent's token (if it has one)."""
        return None

    def reservations(self, job: JobPlan, now: datetime) -> list[Reservation]:
        """The GPUs its launch books until Slurm shows them allocated."""
        return [
            Reservation(
                replica_id=r.replica_id,
                node=r.node,
                gpus=r.sbatch.gpus,
                created_at=now,
                also=r.node_set[1:],
            )
            for r in job.hosts
            if r.node is not None
        ]

    def prepare(self, job: JobPlan, token: str | None) -> None:
        """Its owner-only directory, with what its script reads besides the replicas' own."""
        private_dir(job.job_dir)

    def replica_job_ids(
        self, job: JobPlan, job_id: str | None
    ) -> list[tuple[ReplicaPlan, str | None]]:
        """The Slurm id each hosted replica records once the job is ``job_id`` (None: a job to
        join that has no Slurm id yet; the sweep finds it by its tag)."""
        return [(r, job_id) for r in job.hosts]

    def queued_reason(self, job: JobPlan, replica: ReplicaPlan) -> str:
        return f"submitted; {replica.why}" if replica.why else "submitted"


class PilotShape(KindShape):
    kind = JobKind.PILOT
    own_runs = False

    def hosting(self, job: JobPlan) -> Hosting:
        return Hosting(pilot=job.key)

    def needs_token(self, job: JobPlan) -> bool:
        return job.submits

    def record(
        self, job: JobPlan, plan: DeploymentPlan, token_hash: str | None, now: datetime
    ) -> JobRecord | None:
        if not job.submits:
            return None  # the replicas join a live pilot: its row is there
        return JobRecord(
            key=job.key,
            kind=self.kind,
            node=job.node,
            gpus=job.gpus,
            state=FIRST_JOB_STATE[self.kind],
            token_hash=token_hash,
            job_dir=str(job.job_dir),
            output_path=job.output,
            created_at=now,
            updated_at=now,
        )

    def reservations(self, job: JobPlan, now: datetime) -> list[Reservation]:
        """A new pilot's GPUs, booked on its first replica (released like any other); none for
        replicas that join a live pilot (its GPUs are held already)."""
        if not job.submits or job.node is None or not job.hosts:
            return []
        first = job.hosts[0].replica_id
        return [Reservation(replica_id=first, node=job.node, gpus=job.gpus, created_at=now)]

    def prepare(self, job: JobPlan, token: str | None) -> None:
        if job.spec is None or token is None:
            raise ValueError(f"pilot {job.key} is planned without its agent's spec or token")
        write_agent_dir(job.job_dir, job.spec, token, PILOT_SPEC)

    def queued_reason(self, job: JobPlan, replica: ReplicaPlan) -> str:
        return f"in pilot {job.key}"


class UnitShape(KindShape):
    kind = JobKind.UNIT
    own_runs = False

    def hosting(self, job: JobPlan) -> Hosting:
        return Hosting(unit=job.key)

    def record(
        self, job: JobPlan, plan: DeploymentPlan, token_hash: str | None, now: datetime
    ) -> JobRecord | None:
        return JobRecord(
            key=job.key,
            kind=self.kind,
            deployment=plan.name,
            index=job.index,
            spec=str(plan.request.pd),
            state=FIRST_JOB_STATE[self.kind],
            job_dir=str(job.job_dir),
            created_at=now,
            updated_at=now,
        )

    def replica_job_ids(
        self, job: JobPlan, job_id: str | None
    ) -> list[tuple[ReplicaPlan, str | None]]:
        """Component N of the hetjob is its Nth replica: it records ``JOB+N``."""
        return [(r, f"{job_id}+{het}" if job_id else None) for het, r in enumerate(job.hosts)]

    def queued_reason(self, job: JobPlan, replica: ReplicaPlan) -> str:
        return f"unit {job.key} submitted"


SHAPES: dict[JobKind, KindShape] = {
    shape.kind: shape for shape in (KindShape(), PilotShape(), UnitShape())
}


def shape_of(job: JobPlan) -> KindShape:
    return SHAPES[job.kind]


def shape_hosting(hosting: Hosting) -> KindShape:
    """The shape of the job a replica's row says hosts it (what ``hosting`` gave it)."""
    if hosting.pilot is not None:
        return SHAPES[JobKind.PILOT]
    if hosting.unit is not None:
        return SHAPES[JobKind.UNIT]
    return SHAPES[JobKind.REPLICA]
