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
from xhpc.settings import PdConfig
from xhpc.states import TERMINAL

S = ReplicaState
_HEALTHY = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY})


def role_pool(pool: Sequence[NodeInfo], hostlist: str | None) -> list[NodeInfo]:
    """The nodes a role may run on: the site's list for it (None: any node of the pool)."""
    if not hostlist:
        return list(pool)
    allowed = set(expand_hostlist(hostlist))
    return [n for n in pool if n.name in allowed]


def pd_problems(
    req: ServeRequest, pool: Sequence[NodeInfo], engine: EngineKind, pd: PdConfig
) -> list[str]:
    """What keeps a unit of ``req`` from ever running (empty: admitted). ``pool``: the nodes of
    the request's partition. A unit is all or nothing: every component must fit somewhere."""
    if req.pd is None:
        return []
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
        gpus = (req.prefill_gpus if role is PdRole.PREFILL else req.decode_gpus) or req.gpus
        need += count * gpus
        nodes = role_pool(pool, hostlist)
        fit = [n for n in nodes if n.gpus_total >= gpus and (req.gpu_type in (None, n.gpu_type))]
        where = f"the nodes allowed for {role.value} ({hostlist})" if hostlist else "any node"
        if not fit:
            problems.append(f"no {role.value} instance fits: {gpus} GPU(s) on {where}")
    total = sum(n.gpus_total for n in pool)
    if need > total:
        problems.append(f"a {req.pd} unit needs {need} GPUs; the partition has {total}")
    return problems


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
