"""Turning a validated request into replica plans and sbatch scripts (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xhpc.broker.admit.admission import admission_problems, replica_targets
from xhpc.broker.admit.tags import job_tag, pilot_tag, unit_tag
from xhpc.broker.plan.plans import DeploymentPlan, JobKind, JobPlan, ReplicaPlan
from xhpc.catalog import ResolvedModel, agent_spec
from xhpc.models import EngineKind, PilotSpec, ServeRequest
from xhpc.paths import broker_file_path_in
from xhpc.placement.layout import span_engine_args
from xhpc.render import SbatchParams, render_sbatch
from xhpc.settings import XhpcConfig

__all__ = [
    "DeploymentPlan",
    "JobKind",
    "JobPlan",
    "ReplicaPlan",
    "admission_problems",  # moved to xhpc.broker.admit.admission; re-exported for its callers
    "agent_spec",  # moved to xhpc.catalog; re-exported for its callers
    "choose_engine",
    "job_tag",  # the tags live in xhpc.broker.admit.tags; re-exported for their callers
    "join_pilot",
    "pilot_tag",
    "plan_deployment",
    "plan_pilot",
    "unit_tag",
]


def _render(params: SbatchParams, templates_dir: Path | None) -> str:
    return render_sbatch(params, templates_dir) if templates_dir else render_sbatch(params)


def plan_pilot(
    pilot_id: str,
    node: str,
    gpus: int,
    config: XhpcConfig,
    *,
    broker_id: str,
    agent_python: str,
    partition: str | None = None,
    time: str | None = None,
    gpu_type: str | None = None,
    templates_dir: Path | None = None,
) -> JobPlan:
    """A new pilot job holding ``gpus`` GPUs on ``node``; the launch adds the replicas it hosts."""
    state_dir = config.resolved_state_dir
    pdir = state_dir / "pilots" / pilot_id
    spec = PilotSpec(
        pilot_id=pilot_id,
        node=node,
        gpu_sharing=config.placement.gpu_sharing,
        poll_interval_s=config.broker.pilot_poll_s,
        broker_file=str(broker_file_path_in(state_dir)),
    )
    params = SbatchParams(
        replica_id=pilot_id,
        deployment="pilot",
        job_name=f"xhpc-{pilot_id}",
        comment=pilot_tag(broker_id, pilot_id),
        gpus=gpus,
        gpu_type=gpu_type,
        partition=partition or config.slurm.partition,
        account=config.slurm.account,
        time=time or config.slurm.default_time,
        nodelist=node,
        cpus=config.slurm.cpus_per_replica * max(1, gpus),
        mem_mb=config.slurm.mem_per_replica_mb,
        output=str(pdir / "slurm-%j.out"),
        agent_python=agent_python,
        replica_dir=str(pdir),
        pilot=True,
    )
    return JobPlan(
        kind=JobKind.PILOT,
        key=pilot_id,
        index=0,
        job_dir=pdir,
        tag=params.comment,
        script=_render(params, templates_dir),
        output=params.output,
        node=node,
        gpus=gpus,
        spec=spec.model_dump_json(indent=2),
        hosts=(),
    )


def across_nodes(nodes: int, config: XhpcConfig) -> dict[str, Any]:
    """What an agent of a replica across ``nodes`` nodes is told besides the usual."""
    if nodes <= 1:
        return {}
    return {"nodes": nodes, "execute_timeout_s": config.multi_node.execute_timeout_s}


def choose_engine(req: ServeRequest, model: ResolvedModel, config: XhpcConfig) -> EngineKind:
    return req.engine or model.engine or config.default_engine


def join_pilot(pilot_id: str, config: XhpcConfig, broker_id: str) -> JobPlan:
    """The live pilot ``pilot_id`` as a launch's job: its replicas join it, nothing is submitted."""
    return JobPlan(
        kind=JobKind.PILOT,
        key=pilot_id,
        index=0,
        job_dir=config.resolved_state_dir / "pilots" / pilot_id,
        tag=pilot_tag(broker_id, pilot_id),
        script="",
        hosts=(),
    )


def plan_deployment(
    req: ServeRequest,
    model: ResolvedModel,
    config: XhpcConfig,
    *,
    start_index: int,
    agent_python: str,
    templates_dir: Path | None = None,
    placements: Sequence[str | None] = (),
    broker_id: str = "default",
    pilot: JobPlan | None = None,
    reasons: Sequence[str | None] = (),
) -> DeploymentPlan:
    """A job per replica; ``placements[i]`` is the node chosen for the i-th new replica (None,
    or no entry: Slurm chooses within ``--nodelist``/the partition). A replica config's own node,
    GPU count and GPU type (``req.replica_configs``) win over the placement and the request.
    With ``pilot`` (a new pilot from :func:`plan_pilot`, or a live one from :func:`join_pilot`)
    every replica runs inside that one job on its node: no sbatch of their own. ``reasons[i]``:
    why the placement chose that node (a queue estimate), kept on the replica's plan."""
    engine = choose_engine(req, model, config)
    state_dir = config.resolved_state_dir
    jobs: list[JobPlan] = []
    hosted: list[ReplicaPlan] = []
    targets = replica_targets(req)
    for offset, index in enumerate(range(start_index, start_index + req.replicas)):
        target = targets[offset]
        # One node, or (a replica across nodes) a node set as a Slurm hostlist, its head first.
        chosen = target.node or (placements[offset] if offset < len(placements) else None)
        node = chosen.split(",", 1)[0] if chosen else None
        if pilot is not None:
            node = chosen = req.pilot
        replica_id = f"{model.name}-{index}"
        rdir = state_dir / "replicas" / replica_id
        spec = agent_spec(
            replica_id,
            model,
            engine,
            config,
            args=span_engine_args(req.nodes, req.gpus, req.engine_args),
            engine_config=req.engine_config,
            **across_nodes(req.nodes, config),
        )
        params = SbatchParams(
            replica_id=replica_id,
            deployment=model.name,
            job_name=f"xhpc-{replica_id}",
            comment=job_tag(broker_id, model.name, replica_id),
            gpus=target.gpus or req.gpus,
            gpu_type=target.gpu_type,
            partition=req.partition or config.slurm.partition,
            account=config.slurm.account,
            time=req.time or config.slurm.default_time,
            nodelist=chosen or req.nodelist,
            nodes=req.nodes,
            exclusive=req.nodes > 1 and config.multi_node.whole_nodes,
            cpus=config.slurm.cpus_per_replica,
            mem_mb=config.slurm.mem_per_replica_mb,
            output=str(rdir / "slurm-%j.out"),
            agent_python=agent_python,
            replica_dir=str(rdir),
        )
        replica = ReplicaPlan(
            replica_id=replica_id,
            index=index,
            node=node,
            node_set=tuple(chosen.split(",")) if chosen and pilot is None else (),
            chosen=node is not None and target.node is None and pilot is None,
            why=reasons[offset] if offset < len(reasons) and target.node is None else None,
            gpu_idx=target.gpu_idx,
            replica_dir=rdir,
            spec=spec,
            sbatch=params,
        )
        if pilot is not None:
            hosted.append(replica)
            continue
        jobs.append(
            JobPlan(
                kind=JobKind.REPLICA,
                key=replica_id,
                index=index,
                job_dir=rdir,
                tag=params.comment,
                script=_render(params, templates_dir),
                output=params.output,
                params=params.model_dump_json(indent=2),
                hosts=(replica,),
            )
        )
    if pilot is not None:
        jobs = [pilot.model_copy(update={"hosts": tuple(hosted)})]
    return DeploymentPlan(
        name=model.name, model=model, engine=engine, request=req, jobs=tuple(jobs)
    )
