"""Pilot allocations (pure): admitting a request into a pilot, and a pilot's orders.

A pilot is one job holding K GPUs on one node; replicas run inside it. The broker decides
*which* replicas run in which pilot; the pilot's agent decides *which GPUs* each gets (it is
authoritative inside its allocation, see xhpc.agent.slots).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from xhpc.broker.admit.admission import replica_targets
from xhpc.models import (
    NodeInfo,
    PilotAssignment,
    PilotOrders,
    PilotReport,
    ReplicaState,
    ReplicaView,
    ServeRequest,
)
from xhpc.records import PilotRecord

S = ReplicaState
# Replicas a pilot should be running (LOST: its agent may still run it and report again).
RUN_STATES = frozenset({S.QUEUED, S.STARTING, S.READY, S.LOST})


def pinned_to_pilot(req: ServeRequest) -> ServeRequest:
    """The request as admission sees it: every replica targets the pilot's node."""
    if req.pilot is None:
        return req
    configs = tuple(
        t.model_copy(update={"node": req.pilot}) if t.node in (None, req.pilot) else t
        for t in replica_targets(req)
    )
    return req.model_copy(update={"replica_configs": configs})


def pilot_problems(
    req: ServeRequest,
    node: NodeInfo | None,
    existing: PilotRecord | None,
    *,
    gpu_sharing: bool,
) -> list[str]:
    """What keeps ``req`` out of a pilot on ``req.pilot`` (empty: admitted). The node's own
    state, partition and GPU counts are checked by admission on `pinned_to_pilot(req)`."""
    if req.pilot is None:
        return []
    problems: list[str] = []
    if req.nodelist:
        problems.append("--pilot and --nodelist both name nodes: give one")
    if req.let_slurm_place:
        problems.append("--pilot runs on the pilot's node: --let-slurm-place does not apply")
    targets = replica_targets(req)
    elsewhere = [i for i, t in enumerate(targets) if t.node not in (None, req.pilot)]
    if elsewhere:
        who = ", ".join(str(i) for i in elsewhere)
        problems.append(f"replica config(s) {who} name another node than the pilot's {req.pilot}")
    if existing is not None:
        holds = existing.gpus
        if req.pilot_gpus is not None and req.pilot_gpus != holds:
            problems.append(
                f"the pilot on {req.pilot} ({existing.pilot_id}) holds {holds} GPUs, not "
                f"--pilot-gpus {req.pilot_gpus}"
            )
    else:
        total = node.gpus_total if node is not None else 0
        holds = req.pilot_gpus or total
        if node is not None and req.pilot_gpus is not None and req.pilot_gpus > total:
            problems.append(f"--pilot-gpus {req.pilot_gpus}: node {req.pilot} has {total} GPUs")
    need = [t.gpus or req.gpus for t in targets]
    too_big = [i for i, n in enumerate(need) if n > holds]
    if too_big and holds:
        problems.append(
            f"replica(s) {', '.join(str(i) for i in too_big)} need more GPUs than the "
            f"pilot holds ({holds})"
        )
    elif not gpu_sharing and holds and sum(need) > holds:
        problems.append(
            f"No available slot: {sum(need)} GPUs asked for, the pilot on {req.pilot} holds "
            f"{holds} (gpu sharing is off)"
        )
    return problems


def _assignment(replica: ReplicaView) -> PilotAssignment:
    return PilotAssignment(
        replica_id=replica.replica_id,
        replica_dir=replica.replica_dir or "",
        gpus=len(replica.pinned) or max(1, replica.gpus_asked),
        gpu_idx=replica.pinned,
    )


def pilot_orders(
    report: PilotReport, rows: Sequence[ReplicaView], released: Collection[str]
) -> PilotOrders:
    """What the pilot should run (its replicas in a running state) and stop: what it runs
    that is no longer wanted. A DRAINING replica keeps running until its drain is over
    (``released``): proxies may still have requests in flight to it."""
    run = [r for r in rows if r.state in RUN_STATES and r.replica_dir]
    wanted = {r.replica_id for r in run}
    draining = {r.replica_id for r in rows if r.state is S.DRAINING}
    stop = [
        rid
        for rid in sorted(report.running)
        if rid not in wanted and (rid not in draining or rid in released)
    ]
    return PilotOrders(
        run=tuple(_assignment(r) for r in run),
        stop=tuple(stop),
    )
