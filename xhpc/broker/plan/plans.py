"""The one plan type (pure): a launch is Slurm jobs, each hosting replicas.

Every shape is the same picture. A plain replica is a job hosting one replica; a pilot is a job
holding a node's GPUs and hosting several; a PD unit is one heterogeneous job whose components are
its prefill and decode instances, in hetjob order. The launcher (xhpc.broker.desks.launcher)
records a plan's rows, then submits each job that has a script, and aborts the whole launch if
one fails.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xhpc.catalog import ResolvedModel
from xhpc.models import AgentSpec, EngineKind, JobKind, ServeRequest
from xhpc.render import SbatchParams

__all__ = ["DeploymentPlan", "JobKind", "JobPlan", "ReplicaPlan"]


class ReplicaPlan(BaseModel):
    """One replica a job hosts: its files, its agent's spec, its GPUs."""

    model_config = ConfigDict(frozen=True)

    replica_id: str
    index: int
    node: str | None  # the node in --nodelist (xhpc's choice or the replica config's pin)
    node_set: tuple[str, ...] = ()  # a replica across nodes: xhpc's choice of set, head first
    chosen: bool = False  # ``node`` is xhpc's (advisory) choice, so it may be re-planned
    replica_dir: Path
    spec: AgentSpec
    sbatch: SbatchParams  # the replica's view of its job (GPUs asked, tag, output)
    gpu_idx: tuple[int, ...] = ()  # pinned GPU indexes (inside a pilot)
    why: str | None = None  # the placement's reason for ``node``, when it says more than "idle"


class JobPlan(BaseModel):
    """One Slurm job of a launch and the replicas it hosts."""

    model_config = ConfigDict(frozen=True)

    kind: JobKind
    key: str  # the job's own name: its replica's id, the pilot's id or the unit's id
    index: int
    job_dir: Path  # owner-only: the script (and a pilot's spec) live here
    tag: str  # the job's --comment, by which a lost submission is found again
    script: str  # empty: the replicas join the live pilot ``key`` (nothing is submitted)
    output: str | None = None
    params: str | None = None  # what the script was rendered from (a re-plan renders it again)
    node: str | None = None  # a pilot's node
    gpus: int = 0  # the GPUs a pilot holds
    spec: str | None = None  # a pilot's agent spec (JSON)
    hosts: tuple[ReplicaPlan, ...]

    @property
    def submits(self) -> bool:
        return bool(self.script)


class DeploymentPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    model: ResolvedModel
    engine: EngineKind
    request: ServeRequest
    jobs: tuple[JobPlan, ...]

    @property
    def replicas(self) -> tuple[ReplicaPlan, ...]:
        """Every replica the plan's jobs host, in job order (components in hetjob order)."""
        return tuple(r for job in self.jobs for r in job.hosts)

    def scripts(self) -> dict[str, str]:
        """The sbatch script of each job this plan submits, by the job's key."""
        return {job.key: job.script for job in self.jobs if job.submits}
