"""A catalog model's parallel layout against a partition's nodes, and a replica's parallel
sizes across nodes (pure).

``[models.NAME.layouts.TYPE]`` (``xhpc.settings.ParallelLayout``) says how a replica is split:
tp x pp x dp GPUs, ``per_node`` on each of ``nodes`` nodes. Before anything is submitted,
admission checks that the partition has that many usable nodes with that many GPUs of the type
(``layout_problems``); the engine is told its sizes by ``layout_engine_args`` (vLLM's flags).
"""

from __future__ import annotations

from collections.abc import Sequence

from xhpc.models import NodeInfo
from xhpc.settings import ParallelLayout


def layout_text(layout: ParallelLayout) -> str:
    """``tp=8 pp=2`` (and ``dp``, ``ep`` when set): how admission names a layout."""
    parts = [f"tp={layout.tp}", f"pp={layout.pp}"]
    if layout.dp > 1:
        parts.append(f"dp={layout.dp}")
    if layout.expert_parallel:
        parts.append("ep")
    return " ".join(parts)


def layout_problems(
    layout: ParallelLayout,
    pool: Sequence[NodeInfo],
    gpu_type: str | None,
    partition: str | None,
) -> list[str]:
    """Why the partition's nodes (``pool``) cannot hold one replica of ``layout``: fewer than
    ``layout.nodes`` usable nodes with ``layout.per_node`` GPUs of ``gpu_type``. Total GPUs are
    counted, not free ones: a busy partition queues the job, a too small one never runs it."""
    typed = [n for n in pool if gpu_type is None or n.gpu_type == gpu_type]
    big = [n for n in typed if n.gpus_total >= layout.per_node]
    usable = [n for n in big if n.usable]
    if len(usable) >= layout.nodes:
        return []
    where = f" in partition {partition!r}" if partition else ""
    kind = f" {gpu_type}" if gpu_type else ""
    need = (
        f"layout {layout_text(layout)} needs {layout.nodes} node(s) with {layout.per_node}"
        f"{kind} GPU(s) each{where}"
    )
    if len(big) > len(usable):
        return [f"{need}: {len(usable)} usable (and {len(big) - len(usable)} down or drained)"]
    largest = max((n.gpus_total for n in typed), default=0)
    return [f"{need}: {len(usable)} have that many (the largest has {largest})"]


def layout_engine_args(layout: ParallelLayout) -> tuple[str, ...]:
    """The engine's parallel sizes as vLLM takes them."""
    args = [f"--tensor-parallel-size={layout.tp}", f"--pipeline-parallel-size={layout.pp}"]
    if layout.dp > 1:
        args.append(f"--data-parallel-size={layout.dp}")
    if layout.expert_parallel:
        args.append("--enable-expert-parallel")
    return tuple(args)


# vLLM's flags for its parallel sizes, long and short: how a deployment's engine arguments say
# them (``--flag=V`` or ``--flag V``).
_SIZE_FLAGS = {
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
}


def parallel_sizes(args: Sequence[str]) -> dict[str, int]:
    """The tensor and pipeline sizes ``args`` set (``tp``, ``pp``; absent: not set). A value
    that is not a whole number is left out (the engine refuses it itself)."""
    sizes: dict[str, int] = {}
    items = list(args)
    for i, arg in enumerate(items):
        flag, eq, value = arg.partition("=")
        key = _SIZE_FLAGS.get(flag.replace("_", "-"))
        if key is None:
            continue
        if not eq:
            value = items[i + 1] if i + 1 < len(items) else ""
        if value.isdigit():
            sizes[key] = int(value)
    return sizes


def span_engine_args(
    nodes: int, gpus: int, args: Sequence[str], *, pipeline: bool = True
) -> tuple[str, ...]:
    """``args`` for a replica on ``nodes`` nodes of ``gpus`` GPUs each: when they set neither
    parallel size, tensor parallelism inside each node and the pipeline across nodes
    (``pipeline=False``: tensor parallelism across all of them, as a PD unit's decode side
    needs)."""
    if nodes <= 1 or parallel_sizes(args):
        return tuple(args)
    if not pipeline:
        return (*args, f"--tensor-parallel-size={nodes * gpus}")
    return (*args, f"--tensor-parallel-size={gpus}", f"--pipeline-parallel-size={nodes}")


def span_problems(
    nodes: int, gpus: int, args: Sequence[str], pool: Sequence[NodeInfo], gpu_type: str | None
) -> list[str]:
    """Why one engine cannot span ``nodes`` nodes of ``gpus`` GPUs each: its parallel sizes
    (``tp x pp``) are not the ``nodes x gpus`` GPUs it is given, or the partition (``pool``)
    has fewer usable nodes with that many GPUs of the type."""
    problems: list[str] = []
    sizes = parallel_sizes(args)
    if sizes:
        tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
        if tp * pp != nodes * gpus:
            problems.append(
                f"tensor x pipeline parallel size {tp} x {pp} = {tp * pp} is not the "
                f"{nodes} x {gpus} = {nodes * gpus} GPUs of --nodes {nodes} --gpus {gpus}"
            )
    typed = [n for n in pool if gpu_type is None or n.gpu_type == gpu_type]
    usable = [n for n in typed if n.usable and n.gpus_total >= gpus]
    if typed and len(usable) < nodes:
        kind = f" {gpu_type}" if gpu_type else ""
        problems.append(
            f"--nodes {nodes} needs {nodes} usable nodes with {gpus}{kind} GPU(s) each: "
            f"the partition has {len(usable)}"
        )
    return problems
