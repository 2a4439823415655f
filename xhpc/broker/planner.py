"""Turning a validated request into replica plans and sbatch scripts (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xhpc.catalog import ResolvedModel
from xhpc.models import AgentSpec, EngineKind, NodeInfo, ServeRequest
from xhpc.placement import expand_hostlist
from xhpc.render import SbatchParams, render_sbatch
from xhpc.settings import XhpcConfig


class ReplicaPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    replica_id: str
    index: int
    node: str | None  # xhpc's (advisory) choice; None: Slurm chooses
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


def admission_problems(
    req: ServeRequest, nodes: list[NodeInfo], config: XhpcConfig, engine: EngineKind
) -> list[str]:
    """Every reason the request cannot run on this cluster (empty list: admitted)."""
    problems: list[str] = []
    partition = req.partition or config.slurm.partition
    pool = [n for n in nodes if partition is None or partition in n.partitions]
    if partition is not None and not pool:
        known = sorted({p for n in nodes for p in n.partitions})
        problems.append(f"unknown partition {partition!r} (known: {', '.join(known) or 'none'})")
    most = max((n.gpus_total for n in pool), default=0)
    if pool and req.gpus > most:
        problems.append(f"--gpus {req.gpus} is more than any node has (largest: {most} GPUs)")
    if req.nodelist:
        by_name = {n.name: n for n in pool}
        listed = list(expand_hostlist(req.nodelist))
        missing = [x for x in listed if x not in by_name]
        if missing:
            problems.append(f"unknown node(s) {', '.join(missing)} in the partition")
        for node in (by_name[x] for x in listed if x in by_name):
            if not node.usable:
                flags = "+".join((node.state, *node.state_flags))
                why = f": {node.reason}" if node.reason else ""
                problems.append(f"node {node.name} is not usable ({flags}{why})")
            elif req.gpus > node.gpus_total:
                problems.append(f"node {node.name} has only {node.gpus_total} GPUs")
    elif pool and not any(n.usable and n.gpus_total >= req.gpus for n in pool):
        problems.append("no usable node (all are down, drained or too small)")
    ecfg = config.engine(engine)
    if engine is EngineKind.COMMAND and not ecfg.command:
        problems.append("engine 'command' has no command configured in the site config")
    if ecfg.python is not None and not ecfg.python.exists():
        problems.append(f"engine {engine.value!r}: its Python {ecfg.python} does not exist")
    return problems


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
    no entry: Slurm chooses within ``--nodelist``/the partition)."""
    engine = choose_engine(req, model, config)
    ecfg = config.engine(engine)
    state_dir = config.resolved_state_dir
    plans: list[ReplicaPlan] = []
    for offset, index in enumerate(range(start_index, start_index + req.replicas)):
        node = placements[offset] if offset < len(placements) else None
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
            gpus=req.gpus,
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
                replica_dir=rdir,
                spec=spec,
                sbatch=params,
                script=script,
            )
        )
    return DeploymentPlan(
        name=model.name, model=model, engine=engine, request=req, replicas=tuple(plans)
    )
