"""The sweep applied: jobs found by their tag adopted or cancelled, phantom pilots ended.

Run it once at broker start-up and then on a timer, under the broker's serve lock (no launch or
re-plan is then between sbatch and the store), with a squeue view taken *before* the call: the
rows are read here, after it (see xhpc.broker.watch.sweep for why, and for the rules).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from xhpc.broker.admit.tags import TagKind
from xhpc.broker.desks.launcher import adopt_job, current_user
from xhpc.broker.watch.lifecycle import Lifecycle
from xhpc.broker.watch.sweep import DEFAULT_GRACE_S, SweepAction, SweepKind, plan_sweep
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError, XhpcError
from xhpc.models import Frozen, JobInfo, PilotState, ReplicaState
from xhpc.records import PilotRecord
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store
from xhpc.store.pilots import Pilots
from xhpc.store.units import Units

log = logging.getLogger(__name__)
S = ReplicaState


class SweepResult(Frozen):
    action: SweepAction
    applied: bool
    error: str | None = None


def log_line(act: SweepAction) -> str:
    """One structured line: ``sweep action=cancel job=123 replica=m-0 reason="..."``."""
    parts = [f"sweep action={act.kind.value}"]
    if act.job_id is not None:
        parts.append(f"job={act.job_id}")
    parts.append(f"{act.subject.value}={act.name}")
    replicas = [rid for rid, _ in act.records if rid != act.name] + list(act.fails)
    if replicas:
        parts.append(f"replicas={','.join(replicas)}")
    parts.append(f"reason={json.dumps(act.reason)}")
    return " ".join(parts)


class SweepDesk:
    def __init__(
        self,
        store: Store,
        slurm: SlurmClient,
        lifecycle: Lifecycle,
        broker_id: str,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        user: str | None = None,
    ) -> None:
        self.store = store
        self.slurm = slurm
        self.lifecycle = lifecycle
        self.broker_id = broker_id
        self.grace_s = grace_s
        self.user = user if user is not None else current_user()
        self.pilots = Pilots(store)
        self.units = Units(store)

    def plan(self, jobs: Sequence[JobInfo]) -> list[SweepAction]:
        """What the sweep would do now (ended pilots and units count as missing rows)."""
        return plan_sweep(
            self.broker_id,
            self.store.replicas(),
            self.pilots.not_ended(),
            self.units.live(stopping=True),
            jobs,
            now=utcnow(),
            grace_s=self.grace_s,
            user=self.user,
        )

    async def run(self, jobs: Sequence[JobInfo]) -> list[SweepResult]:
        """Plan against ``jobs`` (squeue, taken before this call) and apply every action."""
        return [await self._apply(act) for act in self.plan(jobs)]

    async def _apply(self, act: SweepAction) -> SweepResult:
        line = log_line(act)
        try:
            if act.kind is SweepKind.CANCEL:
                await self.slurm.cancel([act.job_id] if act.job_id else [])
                applied = act.job_id is not None
            elif act.kind is SweepKind.ADOPT:
                applied = self._adopt(act)
            else:
                applied = self._fail_pilot(act)
        except XhpcError as err:
            log.warning("%s error=%s", line, json.dumps(err.one_line()))
            return SweepResult(action=act, applied=False, error=err.one_line())
        if not applied:
            log.info("%s skipped=%s", line, json.dumps("state changed"))
            return SweepResult(action=act, applied=False, error="state changed")
        log.warning("%s", line)
        return SweepResult(action=act, applied=True)

    def _adopt(self, act: SweepAction) -> bool:
        """The pilot's or unit's job first, then each replica's (a crash in between leaves
        job-less replicas of a row that has a job: the next sweep gives them theirs)."""
        if act.subject is TagKind.PILOT and act.job_id is not None:
            if self.pilots.get(act.name).job_id not in (None, act.job_id):
                return False
            self.pilots.place(act.name, act.job_id, f"sweep: {act.reason}")
        elif act.subject is TagKind.UNIT and act.job_id is not None:
            if self.units.get(act.name).job_id not in (None, act.job_id):
                return False
            self.units.place(act.name, act.job_id)
        applied = True
        for rid, job_id in act.records:
            row = self.store.replica(rid)
            if row.job_id not in (None, job_id):
                applied = False
                continue
            applied &= adopt_job(self.store, self.lifecycle, row, job_id, f"sweep: {act.reason}")
        return applied

    def _fail_pilot(self, act: SweepAction) -> bool:
        """Its job-less replicas FAILED first, then the pilot ENDED: a crash in between leaves
        a phantom with fewer replicas, for the next sweep."""
        try:
            pilot: PilotRecord | None = self.pilots.get(act.name)
        except NotFoundError:
            pilot = None
        if pilot is not None and pilot.job_id is not None:
            return False
        for rid in act.fails:
            row = self.store.replica(rid)
            if row.job_id is None:
                self.lifecycle.move(row, S.FAILED, f"sweep: {act.reason}")
        if pilot is not None and pilot.state is not PilotState.ENDED:
            self.pilots.transition(act.name, PilotState.ENDED, act.reason)
        return True
