"""Turning a validated request into replica plans and sbatch scripts (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xhpc.broker.admission import admission_problems, replica_targets
from xhpc.catalog import ResolvedModel
from xhpc.models import AgentSpec, EngineKind, ServeRequest
from xhpc.render import SbatchParams, render_sbatch
from xhpc.settings import XhpcConfig

__all__ = [
    "DeploymentPlan",
    "ReplicaPlan",
    "admission_problems",  # moved to xhpc.broker.admission; re-exported for its callers
    "choose_engine",
    "plan_deployment",
]


class ReplicaPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    replica_id: str
    index: int
    node: str | None  # the node in --nodelist (xhpc's choice or the replica config's pin)
    chosen: bool = False  # ``node`` is xhpc's (advisory) choice, so it may be re-planned
    replica_dir: Path
    spec: AgentSpec
    sbatch: SbatchParams
    script: str


class DeploymentPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    model: ResolvedModel
    engine: EngineKind
    request: ServeRequest
    replicas: tuple[ReplicaPlan, ...]


def choose_engine(req: ServeRequest, model: ResolvedModel, config: XhpcConfig) -> EngineKind:
    return req.engine or model.engine or config.default_engine


def plan_deployment(
    req: ServeRequest,
    model: ResolvedModel,
    config: XhpcConfig,
    *,
    start_index: int,
    agent_python: str,
    templates_dir: Path | None = None,
    placements: Sequence[str | None] = (),
) -> DeploymentPlan:
    """Replica plans; ``placements[i]`` is the node chosen for the i-th new replica (None, or
    no entry: Slurm chooses within ``--nodelist``/the partition). A replica config's own node,
    GPU count and GPU type (``req.replica_configs``) win over the placement and the request."""
    engine = choose_engine(req, model, config)
    ecfg = config.engine(engine)
    state_dir = config.resolved_state_dir
    plans: list[ReplicaPlan] = []
    targets = replica_targets(req)
    for offset, index in enumerate(range(start_index, start_index + req.replicas)):
        target = targets[offset]
        node = target.node or (placements[offset] if offset < len(placements) else None)
        replica_id = f"{model.name}-{index}"
        rdir = state_dir / "replicas" / replica_id
        spec = AgentSpec(
            replica_id=replica_id,
            deployment=model.name,
            engine=engine,
            model_path=str(model.path),
            served_model=model.name,
            python=str(ecfg.python) if ecfg.python else None,
            command=tuple(ecfg.command),
            args=(*ecfg.args, *req.engine_args),
            env=dict(ecfg.env),
            cpu_only=config.cpu_only,
            startup_timeout_s=ecfg.startup_timeout_s,
            heartbeat_interval_s=config.broker.heartbeat_interval_s,
            broker_file=str(state_dir / "broker.json"),
        )
        params = SbatchParams(
            replica_id=replica_id,
            deployment=model.name,
            job_name=f"xhpc-{replica_id}",
            comment=f"xhpc:{model.name}:{replica_id}",
            gpus=target.gpus or req.gpus,
            gpu_type=target.gpu_type,
            partition=req.partition or config.slurm.partition,
            account=config.slurm.account,
            time=req.time or config.slurm.default_time,
            nodelist=node or req.nodelist,
            cpus=config.slurm.cpus_per_replica,
            mem_mb=config.slurm.mem_per_replica_mb,
            output=str(rdir / "slurm-%j.out"),
            agent_python=agent_python,
            replica_dir=str(rdir),
        )
        script = render_sbatch(params, templates_dir) if templates_dir else render_sbatch(params)
        plans.append(
            ReplicaPlan(
                replica_id=replica_id,
                index=index,
                node=node,
                chosen=node is not None and target.node is None,
                replica_dir=rdir,
                spec=spec,
                sbatch=params,
                script=script,
            )
        )
    return DeploymentPlan(
        name=model.name, model=model, engine=engine, request=req, replicas=tuple(plans)
    )
