"""Asking Slurm where a replica that fits nowhere now would start first (``sbatch --test-only``).

The broker's side of :mod:`xhpc.placement.waiting`: one estimate per candidate node, asked
together and bounded by ``placement.estimate_timeout_s`` (a call not back by then is killed and
left out), so a full cluster adds at most that much to `xhpc serve`, whatever its size.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from xhpc.broker.plan.plans import DeploymentPlan
from xhpc.errors import SlurmError
from xhpc.models import StartEstimate
from xhpc.placement import ClusterSnapshot, PlacementRequest
from xhpc.placement.waiting import Candidate, earliest, queue_candidates, spread, waiting_reason
from xhpc.render import shape_options
from xhpc.settings import PlacementConfig
from xhpc.slurm.client import SlurmClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueChoice:
    """Where each waiting replica queues, and why (both None: Slurm chooses)."""

    nodes: tuple[str | None, ...]
    reasons: tuple[str | None, ...]


async def ask(
    slurm: SlurmClient, candidates: Sequence[Candidate], options: Sequence[str], timeout_s: float
) -> dict[Candidate, StartEstimate]:
    """Slurm's estimate per candidate; those that failed or were too slow are not in it."""
    if not candidates:
        return {}
    tasks = {
        asyncio.ensure_future(slurm.estimate_start(options, c.partition, c.node)): c
        for c in candidates
    }
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
        log.info("%d start estimate(s) not back in %.1fs: skipped", len(pending), timeout_s)
    out: dict[Candidate, StartEstimate] = {}
    for task in done:
        err = task.exception()
        if err is None:
            out[tasks[task]] = task.result()
        elif isinstance(err, SlurmError):
            log.info("no start estimate for %s: %s", tasks[task].node, err.one_line())
        else:
            raise err
    return out


async def choose(
    slurm: SlurmClient,
    snapshot: ClusterSnapshot,
    request: PlacementRequest,
    waiting: int,
    options: Sequence[str],
    config: PlacementConfig,
) -> QueueChoice:
    """A node (and the placement's reason) for each of ``waiting`` replicas of ``request``'s
    shape that fit nowhere now: the candidate Slurm expects to start such a job first, the
    next for the next replica; none when Slurm gave no estimate."""
    candidates = queue_candidates(snapshot, request, config.estimate_candidates)
    estimates = await ask(slurm, candidates, options, config.estimate_timeout_s)
    ranked = earliest(candidates, estimates)
    picks = spread(ranked, waiting)
    if not picks:
        return QueueChoice((None,) * waiting, (None,) * waiting)
    when = dict(ranked)
    reasons = tuple(waiting_reason(c, when[c]) for c in picks)
    log.info("placement: %s (%d estimate(s) asked)", reasons[0], len(candidates))
    return QueueChoice(tuple(c.node for c in picks), reasons)


async def for_plan(
    slurm: SlurmClient,
    snapshot: ClusterSnapshot,
    request: PlacementRequest,
    plan: DeploymentPlan,
    config: PlacementConfig,
) -> QueueChoice | None:
    """The plan's replicas that got no node (nothing idle fits them) queued on Slurm's
    earliest estimates; the others keep theirs. None: nothing to change (every replica has a
    node, estimates are off, or Slurm gave none)."""
    waiting = [r for r in plan.replicas if r.node is None]
    if not waiting or config.estimate_candidates == 0:
        return None
    one = request.model_copy(update={"replicas": 1})
    options = shape_options(waiting[0].sbatch)
    choice = await choose(slurm, snapshot, one, len(waiting), options, config)
    if all(n is None for n in choice.nodes):
        return None
    picked = {r.replica_id: i for i, r in enumerate(waiting)}
    nodes: list[str | None] = []
    reasons: list[str | None] = []
    for r in plan.replicas:
        i = picked.get(r.replica_id)
        placed = ",".join(r.node_set) if r.node_set else r.node  # a set stays a set
        nodes.append(placed if i is None else choice.nodes[i])
        reasons.append(None if i is None else choice.reasons[i])
    return QueueChoice(tuple(nodes), tuple(reasons))
