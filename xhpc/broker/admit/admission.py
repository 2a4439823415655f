"""Admission: every reason a request cannot run, found before the first sbatch (pure).

Like Xinference's ``_resolve_replica_config``: every replica's target is checked against the live
Slurm snapshot before anything launches, and all problems are reported at once (the caller raises
one :class:`~xhpc.errors.AdmissionError` naming them; nothing is submitted).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from xhpc.broker.admit.job_policy import JobShape, policy_problems
from xhpc.broker.plan.units import role_gpus, role_nodes
from xhpc.catalog import engine_env_hint, engine_word, engine_word_problems, shown_names
from xhpc.engine_schema import engine_config_problems
from xhpc.errors import SlurmParseError
from xhpc.models import (
    EngineKind,
    NodeInfo,
    PartitionInfo,
    PdRole,
    ReplicaConfig,
    ServeRequest,
)
from xhpc.placement import expand_hostlist
from xhpc.placement.layout import layout_problems, span_problems
from xhpc.render import SIGNAL_LEAD_S
from xhpc.settings import XhpcConfig
from xhpc.slurm.partitions import (
    access_problems,
    format_minutes,
    parse_slurm_time,
    time_limit_problems,
)


def _flags(names: str) -> frozenset[str]:
    return frozenset(names.split())


# Flags xhpc itself sets on the engine's command line: a user value would break routing or auth.
RESERVED_ARGS: Mapping[str, str] = {
    "--model": "xhpc sets it",
    "--served-model-name": "xhpc sets it",
    "--host": "xhpc sets it",
    "--port": "xhpc sets it",
    "--api-key": "xhpc sets it",
}
VLLM_ARGS = _flags(
    "--block-size --cpu-offload-gb --disable-log-requests --disable-log-stats --dtype "
    "--enable-chunked-prefill --enable-prefix-caching --enforce-eager --gpu-memory-utilization "
    "--kv-cache-dtype --kv-cache-memory-bytes --max-model-len --max-num-batched-tokens "
    "--max-num-seqs --no-enable-chunked-prefill --no-enable-prefix-caching --quantization --seed "
    "--swap-space --tensor-parallel-size -q -tp --runner --convert --pipeline-parallel-size -pp "
    "--data-parallel-size -dp --enable-expert-parallel"
)
TRANSFORMERS_ARGS = _flags(
    "--attn-implementation --cb-block-size --cb-max-batch-tokens --cb-max-memory-percent "
    "--cb-num-blocks --cb-use-cuda-graph --compile --continuous-batching --default-seed --dtype "
    "--log-level --no-cb-use-cuda-graph --no-compile --no-continuous-batching --quantization "
    "--reasoning"
)
# None: any flag (the `command` engine's command line is the site's own).
DEFAULT_ENGINE_ARGS: Mapping[EngineKind, frozenset[str] | None] = {
    EngineKind.VLLM: VLLM_ARGS,
    EngineKind.TRANSFORMERS: TRANSFORMERS_ARGS,
    EngineKind.COMMAND: None,
}
_NUMBER = re.compile(r"^-\d+(\.\d+)?([eE][-+]?\d+)?$")


def _replicas(indexes: Sequence[int]) -> str:
    """ "replica 2", "replicas 0 and 2", "replicas 0, 1 and 2"."""
    if len(indexes) == 1:
        return f"replica {indexes[0]}"
    return f"replicas {', '.join(map(str, indexes[:-1]))} and {indexes[-1]}"


def _state(node: NodeInfo) -> str:
    flags = "+".join((node.state, *node.state_flags))
    return f"{flags}: {node.reason}" if node.reason else flags


def _typed(gpu_type: str | None) -> str:
    return f" of type {gpu_type!r}" if gpu_type else ""


def replica_targets(req: ServeRequest) -> list[ReplicaConfig]:
    """Each replica's effective target: its own config with the request's GPU count and type
    filled in (``node=None``: placement or Slurm chooses)."""
    configs = req.replica_configs
    return [
        ReplicaConfig(
            node=rc.node,
            gpus=rc.gpus or req.gpus,
            gpu_type=rc.gpu_type or req.gpu_type,
            gpu_idx=rc.gpu_idx,
        )
        for rc in (configs[i] if i < len(configs) else ReplicaConfig() for i in range(req.replicas))
    ]


def find_partition(name: str | None, partitions: Sequence[PartitionInfo]) -> PartitionInfo | None:
    """The partition called ``name``, or Slurm's default partition when ``name`` is None."""
    for part in partitions:
        if (part.name == name) if name is not None else part.default:
            return part
    return None


def engine_arg_problems(
    engine: EngineKind,
    args: Sequence[str],
    allowed: Mapping[EngineKind, frozenset[str] | None] = DEFAULT_ENGINE_ARGS,
) -> list[str]:
    """``--engine-arg`` values, for every engine: each one word of ``ENGINE_ARG_CHARS`` (no
    control characters, blanks, quotes or shell metacharacters); every flag on the engine's
    allow-list (the ``command`` engine: any flag).

    A flag is an item starting with ``-`` (not a negative number); ``--flag=value`` counts as
    ``--flag``; underscores count as dashes (``--max_model_len``), as engines accept both.
    """
    problems = engine_word_problems(args)
    allow = allowed.get(engine)
    if allow is None:
        return problems
    bad: list[str] = []
    for arg in args:
        if not arg.startswith("-") or _NUMBER.match(arg) or not engine_word(arg):
            continue
        flag = arg.split("=", 1)[0]
        norm = "-" * (len(flag) - len(flag.lstrip("-"))) + flag.lstrip("-").replace("_", "-")
        if norm in allow:
            continue
        why = RESERVED_ARGS.get(norm)
        shown = f"{flag} ({why})" if why else flag
        if shown not in bad:
            bad.append(shown)
    if bad:
        problems.append(
            f"engine argument(s) not allowed for {engine.value}: {', '.join(bad)}; "
            f"allowed: {' '.join(sorted(allow))}"
        )
    return problems


def shortest_time_s(config: XhpcConfig) -> int:
    """The shortest job time limit admitted, in seconds (whole minutes, as Slurm counts): Slurm
    warns a job ``SIGNAL_LEAD_S`` before its end (its replicas drain then), and the keeper
    submits a successor ``lifecycle.handover_floor_s`` before that end at least; a job must
    outlast both, or it is drained or replaced as soon as it is READY."""
    return math.ceil((SIGNAL_LEAD_S + config.lifecycle.handover_floor_s) / 60) * 60


def short_time_problems(raw: str, what: str, config: XhpcConfig) -> list[str]:
    """A time limit below ``shortest_time_s`` (an unreadable one is time_limit_problems')."""
    try:
        minutes = parse_slurm_time(raw)
    except SlurmParseError:
        return []
    shortest = shortest_time_s(config)
    if minutes is None or minutes * 60 >= shortest:
        return []
    floor = config.lifecycle.handover_floor_s
    return [
        f"{what} {raw} is too short: Slurm warns the job {SIGNAL_LEAD_S} s before its limit "
        f"(its replicas drain then) and a successor is started {floor:g} s before its end "
        f"([lifecycle] handover_floor_s); use at least {format_minutes(shortest // 60)}"
    ]


def _size_problems(
    pool: Sequence[NodeInfo], gpus: int, gpu_type: str | None, who: str, partition: str | None
) -> list[str]:
    """Some node of the pool has the GPU type, and as many GPUs."""
    typed = [n for n in pool if gpu_type is None or n.gpu_type == gpu_type]
    if pool and not typed:
        types = sorted({n.gpu_type or "untyped" for n in pool})
        where = f" in partition {partition!r}" if partition else ""
        return [f"no node{where} has GPUs of type {gpu_type!r} (there: {shown_names(types)})"]
    most = max((n.gpus_total for n in typed), default=0)
    if typed and gpus > most:
        return [f"{who} is more than any node{_typed(gpu_type)} has (largest: {most} GPUs)"]
    return []


def _fit_problems(
    pool: Sequence[NodeInfo], listed: Sequence[str], gpus: int, gpu_type: str | None
) -> list[str]:
    """Each usable node of --nodelist fits; without one, some usable node of the pool does."""
    by_name = {n.name: n for n in pool}
    problems: list[str] = []
    for node in (by_name[x] for x in listed if x in by_name and by_name[x].usable):
        if gpus > node.gpus_total:
            problems.append(f"node {node.name} has only {node.gpus_total} GPUs")
        elif gpu_type is not None and node.gpu_type != gpu_type:
            has = node.gpu_type or "untyped"
            problems.append(f"node {node.name} has no GPUs of type {gpu_type!r} ({has})")
    big = [n for n in pool if (gpu_type is None or n.gpu_type == gpu_type) and n.gpus_total >= gpus]
    if not listed and big and not any(n.usable for n in big):  # (too small: _size_problems)
        problems.append("no usable node (all are down, drained or too small)")
    return problems


def _listed_problems(pool: Sequence[NodeInfo], listed: Sequence[str]) -> list[str]:
    by_name = {n.name: n for n in pool}
    missing = [x for x in listed if x not in by_name]
    problems = [f"unknown node(s) {', '.join(missing)} in the partition"] if missing else []
    for node in (by_name[x] for x in listed if x in by_name):
        if not node.usable:
            problems.append(f"node {node.name} is not usable ({_state(node)})")
    return problems


def _target_problems(
    t: ReplicaConfig, nodes: Mapping[str, NodeInfo], partition: str | None, listed: Sequence[str]
) -> list[str]:
    """A replica with a node of its own: the node exists, is usable and fits."""
    node = nodes.get(t.node or "")
    if node is None:
        return [f"unknown node {t.node}"]
    if partition is not None and partition not in node.partitions:
        return [f"node {node.name} is not in partition {partition!r}"]
    if not node.usable:
        return [f"node {node.name} is not usable ({_state(node)})"]
    problems: list[str] = []
    if listed and node.name not in listed:
        problems.append(f"node {node.name} is outside --nodelist")
    if (t.gpus or 0) > node.gpus_total:
        problems.append(f"node {node.name} has only {node.gpus_total} GPUs, not {t.gpus}")
    if t.gpu_type is not None and node.gpu_type != t.gpu_type:
        has = node.gpu_type or "untyped"
        problems.append(f"node {node.name} has no GPUs of type {t.gpu_type!r} ({has})")
    return problems


def _pin_problems(
    targets: Sequence[ReplicaConfig],
    nodes: Mapping[str, NodeInfo],
    listed: Sequence[str],
    gpu_sharing: bool,
    pilot: bool,
) -> list[tuple[int, str] | str]:
    """Pinned GPU indexes: the right number, on a known node, that exist, not shared."""
    found: list[tuple[int, str] | str] = []
    holders: dict[tuple[str, int], list[int]] = defaultdict(list)
    pinned = [i for i, t in enumerate(targets) if t.gpu_idx]
    for i in pinned:
        t = targets[i]
        if len(t.gpu_idx) != t.gpus:
            found.append((i, f"pins {len(t.gpu_idx)} GPU index(es) but asks for {t.gpus} GPUs"))
        twice = sorted({x for x in t.gpu_idx if t.gpu_idx.count(x) > 1})
        if twice:
            found.append((i, f"pins GPU {shown_names(twice)} more than once"))
        where = t.node or (listed[0] if len(listed) == 1 else None)
        if where is None:
            found.append((i, "pins GPU indexes but names no node (node=...)"))
            continue
        node = nodes.get(where)
        missing = [x for x in dict.fromkeys(t.gpu_idx) if node and x >= node.gpus_total]
        if node is not None and missing:
            have = f"GPUs 0-{node.gpus_total - 1}" if node.gpus_total else "no GPUs"
            found.append((i, f"pins GPU {shown_names(missing)}, which {where} lacks ({have})"))
        for x in dict.fromkeys(t.gpu_idx):
            holders[(where, x)].append(i)
    if not gpu_sharing:
        shared: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
        for (where, x), holding in holders.items():
            if len(holding) > 1:
                shared[(where, tuple(holding))].append(x)
        for (where, owners), gpus in shared.items():
            both = "both" if len(owners) == 2 else "all"
            gpu = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {shown_names(sorted(gpus))}"
            found.append(
                f"{_replicas(owners)} are {both} pinned to {gpu} on {where} (gpu sharing is off)"
            )
    if pinned and not pilot:
        verb = "pins" if len(pinned) == 1 else "pin"
        found.append(
            f"{_replicas(pinned)} {verb} GPU indexes, which needs --pilot: xhpc can only choose "
            "GPU indexes inside a pilot allocation (Slurm picks them for a plain job)"
        )
    return found


def _per_replica(found: Iterable[tuple[int, str] | str]) -> list[str]:
    """Group "replica i: problem" pairs that share the problem: "replicas 0 and 2: problem"."""
    grouped: dict[str, list[int]] = defaultdict(list)
    out: list[str] = []
    for item in found:
        if isinstance(item, str):
            out.append(item)
            continue
        i, body = item
        if body not in grouped:
            out.append(body)
        grouped[body].append(i)
    return [f"{_replicas(grouped[p])}: {p}" if p in grouped else p for p in out]


def _partition_problems(
    name: str | None, part: PartitionInfo | None, pool: Sequence[NodeInfo], known: Iterable[str]
) -> list[str]:
    if name is not None and part is None and not pool:
        return [f"unknown partition {name!r} (known: {', '.join(sorted(known)) or 'none'})"]
    problems: list[str] = []
    if name is not None and not pool:
        problems.append(f"partition {name!r} has no nodes")
    if part is not None and part.state != "UP":
        problems.append(f"partition {part.name!r} is {part.state}, not UP: it starts no jobs")
    return problems


def request_shape(req: ServeRequest, targets: Sequence[ReplicaConfig], time: str) -> JobShape:
    """The largest job ``req`` makes, as ``[policy]`` reads it: a replica's, a pilot's (when
    its GPU count is given) or a PD component's GPUs."""
    gpus = [(t.gpus or req.gpus) * req.nodes for t in targets]
    if req.pd is not None:
        gpus += [role_gpus(req, role) * role_nodes(req, role) for role in PdRole]
    if req.pilot is not None and req.pilot_gpus is not None:
        gpus.append(req.pilot_gpus)
    return JobShape(what="the deployment", gpus=max(gpus, default=0), time=time,
                    partition=req.partition)  # fmt: skip


def _across_nodes_problems(
    req: ServeRequest, config: XhpcConfig, engine: EngineKind, pool: Sequence[NodeInfo]
) -> list[str]:
    """A replica of ``req.nodes`` > 1 nodes: the site allows it, one vLLM engine can span
    them, and the partition has the nodes."""
    problems: list[str] = []
    if not config.multi_node.enabled:
        problems.append(
            f"--nodes {req.nodes}: replicas across nodes are off at this site "
            "([multi_node] enabled = false)"
        )
    if engine is not EngineKind.VLLM:
        problems.append(
            f"--nodes {req.nodes}: only the vllm engine spans nodes, not {engine.value}"
        )
    for what, given in (("--pilot", req.pilot), ("--nodelist", req.nodelist)):
        if given is not None:
            problems.append(f"--nodes {req.nodes} cannot be combined with {what}")
    if req.replica_configs:
        problems.append(f"--nodes {req.nodes} cannot be combined with per-replica configs")
    return problems + span_problems(req.nodes, req.gpus, req.engine_args, pool, req.gpu_type)


def admission_problems(
    req: ServeRequest,
    nodes: Sequence[NodeInfo],
    config: XhpcConfig,
    engine: EngineKind,
    partitions: Sequence[PartitionInfo] | None = None,
    *,
    accounting: bool = False,
    qos: str | None = None,
    gpu_sharing: bool = False,
    pilot: bool = False,
    engine_args_allowed: Mapping[EngineKind, frozenset[str] | None] = DEFAULT_ENGINE_ARGS,
    weights: str | None = None,
) -> list[str]:
    """Every reason the request cannot run on this cluster (empty list: admitted).

    ``nodes``: the shared `sinfo` view. ``partitions`` (`scontrol show partition`; None: not
    known, so the partition's state, MaxTime and Allow/Deny lists go unchecked). ``accounting``:
    the site keeps accounting (``AccountingStorageType`` other than ``accounting_storage/none``);
    only then are account (``slurm.account``) and ``qos`` checked. ``pilot``: the request runs
    inside a pilot allocation (only then may replicas pin GPU indexes). ``weights``: the model's
    directory (None: ``req.model``). A model's engine configuration is checked here by its
    types and its chat template; against the engine's own options by the broker, once
    everything else is admitted (reading them imports the engine).
    """
    name = req.partition or config.slurm.partition
    part = find_partition(name, partitions or ())
    if name is None and part is not None:
        name = part.name  # Slurm's default partition
    pool = [n for n in nodes if name is None or name in n.partitions]
    known = {p for n in nodes for p in n.partitions} | {p.name for p in partitions or ()}
    problems = _partition_problems(name, part, pool, known)
    targets = replica_targets(req)
    if req.replica_configs and len(req.replica_configs) != req.replicas:
        problems.append(
            f"{len(req.replica_configs)} replica configs for {req.replicas} replicas "
            "(give one per replica, or none)"
        )
    try:
        listed = list(expand_hostlist(req.nodelist))
    except SlurmParseError as err:
        problems.append(f"--nodelist: {err.message}")
        listed = []
    # Replicas without a node of their own, by (GPU count, GPU type).
    kinds: dict[tuple[int, str | None], list[int]] = defaultdict(list)
    for i, t in enumerate(targets):
        if t.node is None:
            kinds[(t.gpus or 0, t.gpu_type)].append(i)
    for (gpus, gpu_type), which in kinds.items():
        own = (gpus, gpu_type) == (req.gpus, req.gpu_type)
        who = f"--gpus {gpus}" if own else f"{_replicas(which)} ({gpus} GPUs)"
        problems += _size_problems(pool, gpus, gpu_type, who, name)
    problems += _listed_problems(pool, listed)
    for gpus, gpu_type in kinds:
        problems += [p for p in _fit_problems(pool, listed, gpus, gpu_type) if p not in problems]
    by_name = {n.name: n for n in nodes}
    pairs: list[tuple[int, str] | str] = []
    for i, t in enumerate(targets):
        if t.node is not None:
            pairs += [(i, p) for p in _target_problems(t, by_name, name, listed)]
    pairs += _pin_problems(targets, by_name, listed, gpu_sharing, pilot)
    problems += _per_replica(pairs)
    if req.time:
        what, limit = "--time", req.time
    else:
        what, limit = "the default time limit (slurm.default_time)", config.slurm.default_time
    problems += time_limit_problems(limit, what, part)
    problems += short_time_problems(limit, what, config)
    if accounting:  # without it (accounting_storage/none) jobs carry no checked account
        problems += access_problems(part, config.slurm.account, qos)
    problems += policy_problems(request_shape(req, targets, limit), config)
    ecfg = config.engine(engine)
    if engine is EngineKind.COMMAND and not ecfg.command:
        problems.append("engine 'command' has no command configured in the site config")
    if ecfg.python is not None and not ecfg.python.exists():
        problems.append(
            f"engine {engine.value!r}: its Python {ecfg.python} does not exist "
            f"({engine_env_hint(engine.value)})"
        )
    problems += engine_arg_problems(engine, req.engine_args, engine_args_allowed)
    where = weights or req.model
    problems += engine_config_problems(req.engine_config, engine, where, None)
    if req.nodes > 1:
        problems += _across_nodes_problems(req, config, engine, pool)
    if req.pd is None:
        for flag, given in (("--prefill-nodes", req.prefill_nodes),
                            ("--decode-nodes", req.decode_nodes)):  # fmt: skip
            if given is not None:
                problems.append(f"{flag} applies to --pd units only")
    entry = config.models.get(req.model)
    layout = entry.layout(req.gpu_type) if entry is not None else None
    if layout is not None:  # the catalog's parallel layout, against the partition's nodes
        problems += layout_problems(layout, pool, req.gpu_type, name)
    return problems
