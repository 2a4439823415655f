"""What a placement asks for, what it answers, and the typed error when it does not fit (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from xhpc.errors import AdmissionError
from xhpc.models import Frozen
from xhpc.placement.views import NodeView

_SHOWN = 5  # names listed per problem before "and N more"


class PlacementRequest(Frozen):
    """``replicas`` replicas of ``gpus`` GPUs each, every replica on one node (``span`` > 1:
    on that many nodes, ``gpus`` on each: ``xhpc.placement.node_sets``).

    ``partition=None`` places over every partition (admission fills in the site default first);
    ``nodes`` non-empty restricts the candidates to those node names (expand a Slurm hostlist
    with :func:`~xhpc.placement.hostlist.expand_hostlist` first); unknown names are no candidates.
    """

    gpus: int = Field(default=1, ge=1, le=1024)
    replicas: int = Field(default=1, ge=1, le=1024)
    span: int = Field(default=1, ge=1, le=256)  # nodes each replica spans
    whole: bool = False  # whole nodes only (a job with --exclusive): every GPU of each free
    partition: str | None = None
    gpu_type: str | None = None
    nodes: tuple[str, ...] = ()
    # The model's name and the nodes that hold its weights on local disk (the weights cache):
    # among nodes equally idle (or equally good fits), those come first.
    model: str | None = None
    local_nodes: frozenset[str] = frozenset()


class Placement(Frozen):
    """Replica ``replica`` goes to ``node`` with ``gpus`` GPUs; Slurm picks the indexes.
    ``reason``: why that node, in a few words ("n2: idle, holds tiny-llama locally").
    A replica spanning nodes: ``node_set`` (its head, ``node``, first), ``gpus`` on each."""

    replica: int
    node: str
    node_set: tuple[str, ...] = ()
    gpus: int
    gpu_type: str | None = None
    reason: str = ""

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the replica takes, its head first."""
        return self.node_set or (self.node,)

    @property
    def gres(self) -> str:
        """The ``--gres`` value: ``gpu:K`` or ``gpu:TYPE:K``."""
        return f"gpu:{self.gpu_type}:{self.gpus}" if self.gpu_type else f"gpu:{self.gpus}"


class PlacementError(AdmissionError):
    """The request does not fit the snapshot; nothing was placed (no partial result)."""

    def __init__(
        self, problems: Sequence[str], *, request: PlacementRequest, fitted: int, hint: str | None
    ) -> None:
        self.request = request
        self.fitted = fitted  # how many replicas would have fitted before the first that did not
        super().__init__(problems, hint=hint)


def is_candidate(node: NodeView, request: PlacementRequest) -> bool:
    """Usable, in the partition, of the GPU type, among the listed nodes (ignores free GPUs)."""
    return (
        node.usable
        and (request.partition is None or request.partition in node.partitions)
        and (request.gpu_type is None or node.gpu_type == request.gpu_type)
        and (not request.nodes or node.name in request.nodes)
    )


def pick_reason(strategy: str, node: str, free: int, request: PlacementRequest) -> str:
    """Why ``node`` (with ``free`` GPUs free before this pick) was chosen."""
    why = "best fit" if strategy == "pack" else "idle"
    text = f"{node}: {why}, {free} GPU(s) free"
    if node in request.local_nodes:
        text += f", holds {request.model or 'the model'} locally"
    return text


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _state(node: NodeView) -> str:
    flags = "+".join((node.state, *node.state_flags))
    return f"{node.name} ({flags}{': ' + node.reason if node.reason else ''})"


def placement_error(
    nodes: Sequence[NodeView], request: PlacementRequest, placed: Sequence[Placement]
) -> PlacementError:
    """Why replica ``len(placed)`` did not fit on these nodes (a snapshot's, in name order),
    naming every filter that removed nodes."""
    g, fitted = request.gpus, len(placed)
    unit = "GPU" if g == 1 else "GPUs"
    each = f"{g} {unit} each" if request.span == 1 else f"{request.span} nodes x {g} {unit}"
    head = f"replica {fitted} of {request.replicas} ({each}) does not fit"
    if fitted:
        head = f"only {fitted} of {request.replicas} replicas ({each}) fit"
    problems = [head]

    pool = list(nodes)
    if request.nodes:
        known = {n.name for n in pool}
        unknown = [n for n in request.nodes if n not in known]
        if unknown:
            problems.append(f"unknown node(s) {_names(unknown)}")
        pool = [n for n in pool if n.name in request.nodes]
    if request.partition is not None:
        inside = [n for n in pool if request.partition in n.partitions]
        if not inside:
            known_parts = sorted({p for n in nodes for p in n.partitions})
            problems.append(
                f"no candidate node is in partition {request.partition!r} "
                f"(partitions: {_names(known_parts) or 'none'})"
            )
        pool = inside
    if request.gpu_type is not None:
        typed = [n for n in pool if n.gpu_type == request.gpu_type]
        if not typed:
            types = sorted({n.gpu_type for n in pool if n.gpu_type})
            problems.append(
                f"no candidate node has GPU type {request.gpu_type!r} "
                f"(types there: {_names(types) or 'none'})"
            )
        pool = typed

    unusable = [n for n in pool if not n.usable]
    if unusable:
        problems.append(
            f"{len(unusable)} node(s) not usable: {_names([_state(n) for n in unusable])}"
        )
    usable = [n for n in pool if n.usable]
    small = [n.name for n in usable if n.gpus_total - n.unhealthy < g]
    if small:
        problems.append(f"{len(small)} node(s) have fewer than {g} healthy GPUs: {_names(small)}")
    big = [n for n in usable if n.gpus_total - n.unhealthy >= g]
    if big:
        left = {n.name: n.free for n in big}
        for p in placed:
            for node in p.nodes:
                left[node] -= p.gpus
        largest = max(left.values())
        problems.append(
            f"{len(big)} node(s) large enough have {sum(left.values())} free GPU(s) left "
            f"in all, at most {largest} on one node (allocated, reserved, unhealthy or held by a "
            "process outside Slurm)"
        )
        if request.span > 1:
            fit = sum(1 for free in left.values() if free >= g)
            problems.append(f"{fit} node(s) have {g} free GPU(s); a replica needs {request.span}")
    elif request.span > 1 and usable:
        problems.append(f"a replica needs {request.span} nodes of {g} healthy GPU(s)")
    if not nodes:
        problems.append("the snapshot has no nodes")
    return PlacementError(
        problems,
        request=request,
        fitted=fitted,
        hint="ask for fewer GPUs or replicas, another partition, or wait for running jobs",
    )
