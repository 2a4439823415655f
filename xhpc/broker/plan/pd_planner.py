"""PD units (pure): a request with ``--pd xPyD`` becomes units, each one heterogeneous job
whose components are its prefill and decode instances (replica rows with a role): a
:class:`JobPlan` of kind UNIT hosting them in hetjob order."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from xhpc.broker.admit.admission import admission_problems, find_partition
from xhpc.broker.admit.tags import unit_tag
from xhpc.broker.plan.planner import across_nodes, agent_spec, choose_engine
from xhpc.broker.plan.plans import DeploymentPlan, JobKind, JobPlan, ReplicaPlan
from xhpc.broker.plan.units import pd_problems, role_args, role_gpus, role_nodes
from xhpc.catalog import ResolvedModel
from xhpc.models import EngineKind, NodeInfo, PartitionInfo, PdRole, ServeRequest
from xhpc.placement.layout import parallel_sizes
from xhpc.render import PdComponent, PdSbatchParams, SbatchParams, render_pd_sbatch
from xhpc.settings import PdConfig, XhpcConfig

# An instance of a unit is named UNIT-pN or UNIT-dN (its role's initial, its index in the role).
_INSTANCE = re.compile(r"(?P<role>[pd])(?P<n>[0-9]{1,4})")


# vLLM's NIXL connectors: by default (pull) the decode reads the prefill's KV, which needs the
# prefill's registration to hold every layer; a pipelined prefill holds a slice per rank, which
# only the push mode (each prefill rank writes its layers into the decode's blocks) carries.
NIXL_PULL = frozenset({"NixlConnector", "NixlPullConnector"})
NIXL_PUSH = "NixlPushConnector"


def unit_connector(req: ServeRequest, pd: PdConfig) -> str:
    """The KV connector of every instance of ``req``'s units: the site's, or its push mode
    when the prefill instances are pipelined (across nodes) and the site's pulls."""
    pipelined = parallel_sizes(role_args(req, PdRole.PREFILL, pd)).get("pp", 1) > 1
    return NIXL_PUSH if pipelined and pd.connector in NIXL_PULL else pd.connector


def kv_transfer_config(
    pd: PdConfig, role: PdRole, unit_dir: Path, connector: str | None = None
) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for one instance of a unit (``connector``: the unit's,
    :func:`unit_connector`; None: the site's)."""
    cfg: dict[str, object] = {
        "kv_connector": connector or pd.connector,
        "kv_role": "kv_producer" if role is PdRole.PREFILL else "kv_consumer",
    }
    if role is PdRole.DECODE:
        # A KV load that fails (its prefill lost mid-transfer) is recomputed by the decode
        # itself: the client gets a whole answer, never a stream with no finish.
        cfg["kv_load_failure_policy"] = "recompute"
    if pd.kv_buffer_device:
        cfg["kv_buffer_device"] = pd.kv_buffer_device
    extra = {k: v.replace("{unit_dir}", str(unit_dir)) for k, v in pd.extra_config.items()}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def unit_roles(req: ServeRequest) -> list[PdRole]:
    """The unit's components in hetjob order: prefill instances, then decode instances."""
    p, d = req.pd_counts()
    return [PdRole.PREFILL] * p + [PdRole.DECODE] * d


def pd_admission_problems(
    req: ServeRequest,
    nodes: Sequence[NodeInfo],
    config: XhpcConfig,
    engine: EngineKind,
    partitions: Sequence[PartitionInfo] | None = None,
    *,
    accounting: bool = False,
    weights: str | None = None,
) -> tuple[list[str], list[NodeInfo]]:
    """What refuses a PD request (every door: the broker's PD front, a dry run with no broker),
    and the partition's nodes its units may use. The unit's components are checked as plain
    replicas of the larger size (the common checks), then each side by itself."""
    base = req.model_copy(
        update={
            "gpus": max(role_gpus(req, r) for r in PdRole),
            "pd": None,
            "nodes": 1,  # an instance across nodes: its side's checks are pd_problems'
            "prefill_nodes": None,
            "decode_nodes": None,
            "replicas": 1,
            "engine_args": (*req.engine_args, *req.prefill_args, *req.decode_args),
        }
    )
    problems = admission_problems(
        base, list(nodes), config, engine, partitions, accounting=accounting, weights=weights
    )
    name = req.partition or config.slurm.partition
    part = find_partition(name, partitions or ())
    name = name or (part.name if part else None)
    pool = [n for n in nodes if name is None or name in n.partitions]
    problems += [p for p in pd_problems(req, pool, engine, config) if p not in problems]
    return problems, pool


def plan_units(
    req: ServeRequest,
    model: ResolvedModel,
    config: XhpcConfig,
    *,
    start_index: int,
    agent_python: str,
    broker_id: str,
    placements: Sequence[Sequence[str | None]] = (),
    templates_dir: Path | None = None,
) -> DeploymentPlan:
    """``req.replicas`` units from ``start_index``; ``placements[u][c]`` is the node of unit
    u's component c, or its node set (comma-joined, its head first) when the component spans
    nodes (None: Slurm chooses within the partition)."""
    engine = choose_engine(req, model, config)
    state_dir = config.resolved_state_dir
    pd = config.pd
    roles = unit_roles(req)
    connector = unit_connector(req, pd)
    units: list[JobPlan] = []
    for offset, index in enumerate(range(start_index, start_index + req.replicas)):
        unit_id = f"{model.name}-u{index}"
        unit_dir = state_dir / "units" / unit_id
        nodes = placements[offset] if offset < len(placements) else ()
        instances: list[ReplicaPlan] = []
        components: list[PdComponent] = []
        counts = {PdRole.PREFILL: 0, PdRole.DECODE: 0}
        for het, role in enumerate(roles):
            rid = f"{unit_id}-{role.value[0]}{counts[role]}"
            counts[role] += 1
            rdir = state_dir / "replicas" / rid
            chosen = nodes[het] if het < len(nodes) else None
            node = chosen.split(",", 1)[0] if chosen else None
            span = role_nodes(req, role)
            spec = agent_spec(
                rid,
                model,
                engine,
                config,
                args=role_args(req, role, pd),
                engine_config=req.engine_config,
                **across_nodes(span, config),
                env=pd.env,
                pd_role=role,
                het_offset=het,
                kv_transfer=kv_transfer_config(pd, role, unit_dir, connector),
                side_channel=pd.side_channel,
            )
            gpus = role_gpus(req, role)
            # The instance's own sbatch view (for its row and reservation): never submitted.
            params = SbatchParams(
                replica_id=rid,
                deployment=model.name,
                job_name=f"xhpc-{unit_id}",
                comment=unit_tag(broker_id, model.name, unit_id),
                gpus=gpus,
                gpu_type=req.gpu_type,
                partition=req.partition or config.slurm.partition,
                account=config.slurm.account,
                time=req.time or config.slurm.default_time,
                nodelist=chosen,
                nodes=span,
                exclusive=span > 1 and config.multi_node.whole_nodes,
                output=str(unit_dir / "slurm-%j.out"),
                agent_python=agent_python,
                replica_dir=str(rdir),
            )
            instances.append(
                ReplicaPlan(
                    replica_id=rid,
                    index=index,
                    node=node,
                    node_set=tuple(chosen.split(",")) if chosen else (),
                    chosen=False,
                    replica_dir=rdir,
                    spec=spec,
                    sbatch=params,
                )
            )
            components.append(
                PdComponent(
                    replica_id=rid,
                    role=role.value,
                    gpus=gpus,
                    gpu_type=req.gpu_type,
                    nodelist=chosen,
                    nodes=span,
                    exclusive=span > 1 and config.multi_node.whole_nodes,
                    cpus=config.slurm.cpus_per_replica,
                    replica_dir=str(rdir),
                )
            )
        sbatch = PdSbatchParams(
            unit_id=unit_id,
            deployment=model.name,
            job_name=f"xhpc-{unit_id}",
            comment=unit_tag(broker_id, model.name, unit_id),
            partition=req.partition or config.slurm.partition,
            account=config.slurm.account,
            time=req.time or config.slurm.default_time,
            mem_mb=config.slurm.mem_per_replica_mb,
            output=str(unit_dir / "slurm-%j.out"),
            agent_python=agent_python,
            components=tuple(components),
        )
        script = render_pd_sbatch(sbatch, *((templates_dir,) if templates_dir else ()))
        units.append(
            JobPlan(
                kind=JobKind.UNIT,
                key=unit_id,
                index=index,
                job_dir=unit_dir,
                tag=sbatch.comment,
                script=script,
                output=sbatch.output,
                hosts=tuple(instances),
            )
        )
    return DeploymentPlan(
        name=model.name, model=model, engine=engine, request=req, jobs=tuple(units)
    )


def het_offsets(unit_id: str, replica_ids: Sequence[str]) -> dict[str, int] | None:
    """Each instance's component in its unit's hetjob, from the names plan_units gives (``UNIT-pN``
    then ``UNIT-dN``: prefill components first). None when the names do not say."""
    prefill: dict[int, str] = {}
    decode: dict[int, str] = {}
    for rid in replica_ids:
        head, _, tail = rid.rpartition("-")
        match = _INSTANCE.fullmatch(tail)
        if head != unit_id or match is None:
            return None
        (prefill if match["role"] == "p" else decode)[int(match["n"])] = rid
    for role in (prefill, decode):
        if sorted(role) != list(range(len(role))):
            return None
    offsets = {rid: n for n, rid in prefill.items()}
    offsets.update({rid: len(prefill) + n for n, rid in decode.items()})
    return offsets if len(offsets) == len(replica_ids) else None
