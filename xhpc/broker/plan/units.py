"""PD units (pure): admission of a whole unit, and a unit's state from its instances'."""

from __future__ import annotations

from collections.abc import Sequence

from xhpc.models import (
    EngineKind,
    NodeInfo,
    PdRole,
    ReplicaState,
    ReplicaView,
    ServeRequest,
    UnitState,
)
from xhpc.placement import expand_hostlist
from xhpc.placement.layout import parallel_sizes, span_engine_args, span_problems
from xhpc.settings import PdConfig, XhpcConfig
from xhpc.states import TERMINAL

S = ReplicaState
_HEALTHY = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY})


def role_pool(pool: Sequence[NodeInfo], hostlist: str | None) -> list[NodeInfo]:
    """The nodes a role may run on: the site's list for it (None: any node of the pool)."""
    if not hostlist:
        return list(pool)
    allowed = set(expand_hostlist(hostlist))
    return [n for n in pool if n.name in allowed]


def role_gpus(req: ServeRequest, role: PdRole) -> int:
    """The GPUs of each instance of ``role`` (on each of its nodes)."""
    own = req.prefill_gpus if role is PdRole.PREFILL else req.decode_gpus
    return own or req.gpus


def role_nodes(req: ServeRequest, role: PdRole) -> int:
    """The nodes each instance of ``role`` spans (1: one node)."""
    own = req.prefill_nodes if role is PdRole.PREFILL else req.decode_nodes
    return own or req.nodes


def role_args(req: ServeRequest, role: PdRole, pd: PdConfig) -> tuple[str, ...]:
    """An instance's engine arguments: the site's for its role, the deployment's, its role's,
    and (an instance across nodes, unless they say) its parallel sizes. A decode instance
    spans nodes by tensor parallelism: vLLM's KV connectors cannot feed a pipelined decode."""
    site_args = pd.prefill_args if role is PdRole.PREFILL else pd.decode_args
    own_args = req.prefill_args if role is PdRole.PREFILL else req.decode_args
    args = (*site_args, *req.engine_args, *own_args)
    return span_engine_args(
        role_nodes(req, role), role_gpus(req, role), args, pipeline=role is PdRole.PREFILL
    )


def _span_problems(req: ServeRequest, pool: Sequence[NodeInfo], config: XhpcConfig) -> list[str]:
    """A unit whose prefill or decode instances span nodes: the site allows it, and each such
    side's parallel sizes and nodes fit (its decode side is never pipelined)."""
    problems: list[str] = []
    for role, flag in ((PdRole.PREFILL, "--prefill-nodes"), (PdRole.DECODE, "--decode-nodes")):
        span = role_nodes(req, role)
        if span <= 1:
            continue
        if not config.multi_node.enabled:
            problems.append(
                f"{flag} {span}: instances across nodes are off at this site "
                "([multi_node] enabled = false)"
            )
        args = role_args(req, role, config.pd)
        if role is PdRole.DECODE and parallel_sizes(args).get("pp", 1) > 1:
            problems.append(
                f"{flag} {span}: a decode instance spans nodes by tensor parallelism only "
                "(vLLM's KV connectors cannot feed a pipelined decode): drop its "
                "--pipeline-parallel-size"
            )
        hostlist = config.pd.prefill_nodes if role is PdRole.PREFILL else config.pd.decode_nodes
        for p in span_problems(span, role_gpus(req, role), args, role_pool(pool, hostlist),
                               req.gpu_type):  # fmt: skip
            problems.append(f"{role.value}: {p}")
    return problems


def pd_problems(
    req: ServeRequest, pool: Sequence[NodeInfo], engine: EngineKind, config: XhpcConfig
) -> list[str]:
    """What keeps a unit of ``req`` from ever running (empty: admitted). ``pool``: the nodes of
    the request's partition. A unit is all or nothing: every component must fit somewhere."""
    if req.pd is None:
        return []
    pd = config.pd
    problems: list[str] = []
    if engine is not EngineKind.VLLM:
        problems.append(f"--pd needs the vllm engine (its KV connectors), not {engine.value}")
    if req.pilot is not None:
        problems.append("--pd runs each unit as its own heterogeneous job: --pilot does not apply")
    if req.replica_configs:
        problems.append("--pd takes --prefill-gpus/--decode-gpus, not --replica-config")
    p, d = req.pd_counts()
    need = 0
    for role, count, hostlist in (
        (PdRole.PREFILL, p, pd.prefill_nodes),
        (PdRole.DECODE, d, pd.decode_nodes),
    ):
        gpus = role_gpus(req, role)
        need += count * gpus * role_nodes(req, role)
        nodes = role_pool(pool, hostlist)
        fit = [n for n in nodes if n.gpus_total >= gpus and (req.gpu_type in (None, n.gpu_type))]
        where = f"the nodes allowed for {role.value} ({hostlist})" if hostlist else "any node"
        if not fit:
            problems.append(f"no {role.value} instance fits: {gpus} GPU(s) on {where}")
    total = sum(n.gpus_total for n in pool)
    if need > total:
        problems.append(f"a {req.pd} unit needs {need} GPUs; the partition has {total}")
    # Slurm never gives two components of a hetjob the same node.
    spans = p * role_nodes(req, PdRole.PREFILL) + d * role_nodes(req, PdRole.DECODE)
    usable = [n for n in pool if n.usable]
    if pool and spans > len(usable):
        problems.append(
            f"a {req.pd} unit needs {spans} nodes (Slurm gives each of its instances nodes of "
            f"its own); the partition has {len(usable)} usable"
        )
    return problems + _span_problems(req, pool, config)


def unit_state(instances: Sequence[ReplicaView]) -> tuple[UnitState, str | None]:
    """READY when every instance is; DEGRADED when one failed or was lost while another
    lives; ENDED when none is left; STARTING otherwise (with the reason)."""
    states = [r.state for r in instances]
    if not states or all(s in TERMINAL for s in states):
        return UnitState.ENDED, None
    if all(s is S.READY for s in states):
        return UnitState.READY, None
    if all(s in (S.DRAINING, *TERMINAL) for s in states):
        return UnitState.STOPPING, None
    bad = [r for r in instances if r.state in (S.FAILED, S.LOST)]
    if bad and any(r.state in _HEALTHY | {S.DRAINING} for r in instances):
        first = bad[0]
        why = f"{first.replica_id} is {first.state.value}: {first.reason or ''}"
        return UnitState.DEGRADED, why
    return UnitState.STARTING, None
