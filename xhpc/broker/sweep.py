"""The sweep (pure): jobs found by their tag, set against the rows that should account for them.

For this broker's jobs of this user (other brokers' and other users' jobs are never touched):

- never two jobs for one replica, pilot or PD unit: a tagged job its row does not record is
  cancelled, unless the row records no job yet and can take one: then the oldest tagged job is
  adopted (a CREATING replica becomes QUEUED on it) and any other is cancelled;
- never a job without a live row: a tagged job whose row is terminal or missing is cancelled;
- never a phantom pilot: a pilot row with no job and no job tagged for it ends, and its job-less
  replicas fail; a job-less replica of a pilot or unit that has a job takes that job.

A row changed within ``grace_s`` is not judged (the squeue view may predate the change). A
missing row is judged at once: every row is written before its job is submitted, so the caller
must read the rows *after* taking the squeue view. A job counts until Slurm says it is ending
(pending, running, and the states it may run again from); a hetjob counts once, by its leader.
Only tags naming this broker are acted on (an old tag naming no broker is left to `xhpc doctor`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from xhpc.broker.pd_planner import het_offsets
from xhpc.broker.reconcile import ENDED_STATES
from xhpc.broker.tags import JobTag, TagKind, read_tag
from xhpc.models import Frozen, JobInfo, PilotState, ReplicaState, ReplicaView, UnitState
from xhpc.records import PilotRecord, UnitRecord
from xhpc.states import TERMINAL

S = ReplicaState
DEFAULT_GRACE_S = 30.0
_JOBLESS = frozenset({S.CREATING, S.QUEUED})  # where a replica waits for its job to be known
_SUBJECT_ORDER = {TagKind.REPLICA: 0, TagKind.PILOT: 1, TagKind.UNIT: 2}
_LIVE_PILOT = frozenset({PilotState.PENDING, PilotState.RUNNING})


class SweepKind(StrEnum):
    ADOPT = "adopt"  # record the job for the row (and ``records`` for its replicas)
    CANCEL = "cancel"  # scancel the job
    FAIL_PHANTOM_PILOT = "fail-phantom-pilot"  # the pilot ENDED, ``fails`` FAILED


class SweepAction(Frozen):
    kind: SweepKind
    subject: TagKind  # what ``name`` names: a replica, a pilot or a PD unit
    name: str
    job_id: str | None = None  # the job adopted or cancelled (a hetjob: its leader)
    records: tuple[tuple[str, str], ...] = ()  # ADOPT: (replica, job id) each replica records
    fails: tuple[str, ...] = ()  # FAIL_PHANTOM_PILOT: the replicas moved to FAILED
    reason: str


@dataclass(frozen=True)
class _Found:
    key: str  # the id to record or scancel: a hetjob's leader, else the job's own id
    order: int  # Slurm's numeric id: lower was submitted earlier


def job_counts(job: JobInfo) -> bool:
    """Slurm has not ended it: it runs, waits, or may run again (COMPLETING is judged once it
    is pending again, if Slurm requeues it: scancel of a completing job only fails)."""
    state = job.state.upper()
    return state not in ENDED_STATES and state != "COMPLETING"


def _found(job: JobInfo) -> _Found:
    if job.het_job_id is not None:
        return _Found(str(job.het_job_id), job.het_job_id)
    return _Found(job.job_id, job.raw_job_id)


def _ours(job: JobInfo, user: str | None) -> bool:
    return (user is None or job.user == user) and job_counts(job)


def _collect(jobs: Iterable[JobInfo]) -> list[_Found]:
    """One entry per job (a hetjob's components once, by its leader), oldest first."""
    by_key: dict[str, _Found] = {}
    for job in jobs:
        found = _found(job)
        by_key.setdefault(found.key, found)
    return sorted(by_key.values(), key=lambda f: (f.order, f.key))


def find_tagged(jobs: Sequence[JobInfo], tag: str, user: str | None) -> list[str]:
    """The ids of the jobs Slurm has not ended whose comment is exactly ``tag`` (``user``'s
    only, when given), oldest first; a hetjob once, by its leader."""
    return [f.key for f in _collect(j for j in jobs if j.comment == tag and _ours(j, user))]


@dataclass(frozen=True)
class _World:
    rows: dict[str, ReplicaView]
    pilots: dict[str, PilotRecord]
    units: dict[str, UnitRecord]
    now: datetime
    grace: timedelta
    groups: dict[tuple[TagKind, str], list[ReplicaView]]  # a pilot's replicas, a unit's instances

    @classmethod
    def of(
        cls,
        replicas: Iterable[ReplicaView],
        pilots: Iterable[PilotRecord],
        units: Iterable[UnitRecord],
        now: datetime,
        grace_s: float,
    ) -> _World:
        rows = {r.replica_id: r for r in replicas}
        groups: dict[tuple[TagKind, str], list[ReplicaView]] = {}
        for rid in sorted(rows):
            row = rows[rid]
            if row.pilot is not None:
                groups.setdefault((TagKind.PILOT, row.pilot), []).append(row)
            if row.unit is not None:
                groups.setdefault((TagKind.UNIT, row.unit), []).append(row)
        return cls(
            rows=rows,
            pilots={p.pilot_id: p for p in pilots},
            units={u.unit_id: u for u in units},
            now=now,
            grace=timedelta(seconds=grace_s),
            groups=groups,
        )

    def young(self, updated_at: datetime) -> bool:
        return self.now - updated_at < self.grace

    def members(self, pilot: str | None = None, unit: str | None = None) -> list[ReplicaView]:
        """The replicas of a pilot, or the instances of a unit, by id."""
        if pilot is not None:
            return self.groups.get((TagKind.PILOT, pilot), [])
        return self.groups.get((TagKind.UNIT, str(unit)), [])


def _jobless(row: ReplicaView) -> bool:
    return row.job_id is None and row.state in _JOBLESS


@dataclass(frozen=True)
class _Verdict:
    adopt: _Found | None
    cancel: tuple[tuple[_Found, str], ...]


def _judge(
    found: list[_Found], recorded: str | None, can_adopt: bool, gone: str | None
) -> _Verdict:
    """What to do with the tagged jobs of one row: ``gone`` says why it accounts for none."""
    if gone is not None:
        return _Verdict(None, tuple((f, gone) for f in found))
    if recorded is not None and any(f.key == recorded for f in found):
        why = f"a second job for it: its row records job {recorded}"
        return _Verdict(None, tuple((f, why) for f in found if f.key != recorded))
    if recorded is None and can_adopt:
        first, *rest = found
        why = f"a second job for it: job {first.key} is adopted"
        return _Verdict(first, tuple((f, why) for f in rest))
    why = f"its row records job {recorded}" if recorded else "its row records no job, takes none"
    return _Verdict(None, tuple((f, why) for f in found))


def _cancels(verdict: _Verdict, subject: TagKind, name: str) -> list[SweepAction]:
    return [
        SweepAction(kind=SweepKind.CANCEL, subject=subject, name=name, job_id=f.key, reason=why)
        for f, why in verdict.cancel
    ]


def _replica(tag: JobTag, found: list[_Found], w: _World) -> list[SweepAction]:
    row = w.rows.get(tag.name)
    gone: str | None = None
    if row is None:
        gone = "no replica row"
    elif w.young(row.updated_at):
        return []
    elif row.state in TERMINAL:
        gone = f"its replica row is {row.state.value}"
    elif row.deployment != tag.deployment:
        gone = f"its replica row belongs to deployment {row.deployment}"
    elif row.pilot is not None or row.unit is not None:
        gone = "its replica runs in a pilot or unit job, not its own"
    can_adopt = row is not None and row.state is S.CREATING
    verdict = _judge(found, row.job_id if row else None, can_adopt, gone)
    actions = _cancels(verdict, TagKind.REPLICA, tag.name)
    if verdict.adopt is not None:
        job = verdict.adopt.key
        actions.append(
            SweepAction(
                kind=SweepKind.ADOPT,
                subject=TagKind.REPLICA,
                name=tag.name,
                job_id=job,
                records=((tag.name, job),),
                reason="its job was submitted but never recorded",
            )
        )
    return actions


def _pilot(tag: JobTag, found: list[_Found], w: _World) -> list[SweepAction]:
    pilot = w.pilots.get(tag.name)
    gone: str | None = None
    if pilot is None:
        gone = "no live pilot row"
    elif w.young(pilot.updated_at):
        return []
    elif pilot.state is PilotState.ENDED:
        gone = "its pilot row has ENDED"
    can_adopt = pilot is not None and pilot.state in _LIVE_PILOT
    verdict = _judge(found, pilot.job_id if pilot else None, can_adopt, gone)
    actions = _cancels(verdict, TagKind.PILOT, tag.name)
    if verdict.adopt is not None:
        job = verdict.adopt.key
        members = w.members(pilot=tag.name)
        waiting = [r.replica_id for r in members if _jobless(r) and not w.young(r.updated_at)]
        actions.append(
            SweepAction(
                kind=SweepKind.ADOPT,
                subject=TagKind.PILOT,
                name=tag.name,
                job_id=job,
                records=tuple((rid, job) for rid in waiting),
                reason="the pilot's job was submitted but never recorded",
            )
        )
    return actions


def _unit_offsets(unit: UnitRecord, w: _World) -> dict[str, int] | None:
    """The instances' components, when every instance still waits for the unit's job."""
    instances = w.members(unit=unit.unit_id)
    if not instances or not all(r.job_id is None and r.state is S.CREATING for r in instances):
        return None
    return het_offsets(unit.unit_id, [r.replica_id for r in instances])


def _unit(tag: JobTag, found: list[_Found], w: _World) -> list[SweepAction]:
    unit = w.units.get(tag.name)
    gone: str | None = None
    if unit is None:
        gone = "no live unit row"
    elif w.young(unit.updated_at):
        return []
    elif unit.state is UnitState.ENDED:
        gone = "its unit row has ENDED"
    elif unit.deployment != tag.deployment:
        gone = f"its unit row belongs to deployment {unit.deployment}"
    offsets = _unit_offsets(unit, w) if unit is not None else None
    can_adopt = unit is not None and unit.state is UnitState.STARTING and offsets
    verdict = _judge(found, unit.job_id if unit else None, bool(can_adopt), gone)
    actions = _cancels(verdict, TagKind.UNIT, tag.name)
    if verdict.adopt is not None and offsets:
        job = verdict.adopt.key
        actions.append(
            SweepAction(
                kind=SweepKind.ADOPT,
                subject=TagKind.UNIT,
                name=tag.name,
                job_id=job,
                records=tuple((rid, f"{job}+{k}") for rid, k in sorted(offsets.items())),
                reason="the unit's hetjob was submitted but never recorded",
            )
        )
    return actions


def _pilot_rows(w: _World, adopted: set[str]) -> list[SweepAction]:
    """Pilots with no job that adopt none (phantoms: their tagged jobs, if any, are cancelled),
    and job-less replicas of pilots that have a job (they take it) or have ended (they fail)."""
    actions: list[SweepAction] = []
    adopted = set(adopted)
    for pilot in w.pilots.values():
        if pilot.pilot_id in adopted or pilot.job_id is not None or w.young(pilot.updated_at):
            continue
        if pilot.state is PilotState.ENDED:
            continue
        adopted.add(pilot.pilot_id)  # its replicas fail with it
        members = w.members(pilot=pilot.pilot_id)
        waiting = tuple(r.replica_id for r in members if _jobless(r) and not w.young(r.updated_at))
        why = "pilot never submitted: no job recorded, none it can take"
        actions.append(_fail(pilot.pilot_id, waiting, why))
    stranded: dict[str, list[str]] = {}
    for row in w.rows.values():
        if row.pilot is None or row.pilot in adopted:
            continue
        if _jobless(row) and not w.young(row.updated_at):
            stranded.setdefault(row.pilot, []).append(row.replica_id)
    for pilot_id, rids in sorted(stranded.items()):
        owner = w.pilots.get(pilot_id)
        if owner is None or owner.state is PilotState.ENDED:
            actions.append(_fail(pilot_id, tuple(sorted(rids)), "its pilot has ended"))
        elif owner.job_id is not None:
            actions += [_take(rid, owner.job_id, "pilot") for rid in rids]
    return actions


def _unit_rows(w: _World, adopted: set[str]) -> list[SweepAction]:
    """Job-less instances of units that have a job: they take their component of it."""
    actions: list[SweepAction] = []
    for unit in w.units.values():
        if unit.job_id is None or unit.unit_id in adopted:
            continue
        instances = w.members(unit=unit.unit_id)
        waiting = [r.replica_id for r in instances if _jobless(r) and not w.young(r.updated_at)]
        if not waiting:
            continue
        offsets = het_offsets(unit.unit_id, [r.replica_id for r in instances]) or {}
        actions += [
            _take(rid, f"{unit.job_id}+{offsets[rid]}", "unit") for rid in waiting if rid in offsets
        ]
    return actions


def _take(replica_id: str, job_id: str, whose: str) -> SweepAction:
    return SweepAction(
        kind=SweepKind.ADOPT,
        subject=TagKind.REPLICA,
        name=replica_id,
        job_id=job_id,
        records=((replica_id, job_id),),
        reason=f"its {whose}'s job {job_id} was never recorded for it",
    )


def _fail(pilot_id: str, replicas: tuple[str, ...], why: str) -> SweepAction:
    return SweepAction(
        kind=SweepKind.FAIL_PHANTOM_PILOT,
        subject=TagKind.PILOT,
        name=pilot_id,
        fails=replicas,
        reason=why,
    )


def _groups(
    jobs: Sequence[JobInfo], broker_id: str, user: str | None
) -> dict[JobTag, list[_Found]]:
    """This broker's tagged jobs that Slurm has not ended, grouped by tag, oldest first."""
    tagged: dict[JobTag, list[JobInfo]] = {}
    for job in jobs:
        tag = read_tag(job.comment)
        if tag is None or tag.broker != broker_id or not _ours(job, user):
            continue
        tagged.setdefault(tag, []).append(job)
    return {tag: _collect(group) for tag, group in tagged.items()}


def plan_sweep(
    broker_id: str,
    replicas: Iterable[ReplicaView],
    pilots: Iterable[PilotRecord],
    units: Iterable[UnitRecord],
    jobs: Sequence[JobInfo],
    *,
    now: datetime,
    grace_s: float = DEFAULT_GRACE_S,
    user: str | None = None,
) -> list[SweepAction]:
    """Every sweep action, in a stable order. ``replicas`` must include terminal rows; pilots
    and units left out count as ended. ``user``: only that user's jobs (None: any user's)."""
    w = _World.of(replicas, pilots, units, now, grace_s)
    judge = {TagKind.REPLICA: _replica, TagKind.PILOT: _pilot, TagKind.UNIT: _unit}
    actions: list[SweepAction] = []
    groups = _groups(jobs, broker_id, user)
    for tag in sorted(groups, key=lambda t: (t.kind, t.name, t.deployment or "")):
        actions += judge[tag.kind](tag, groups[tag], w)
    adopted = {
        kind: {a.name for a in actions if a.kind is SweepKind.ADOPT and a.subject is kind}
        for kind in (TagKind.PILOT, TagKind.UNIT)
    }
    actions += _pilot_rows(w, adopted[TagKind.PILOT])
    actions += _unit_rows(w, adopted[TagKind.UNIT])
    return sorted(
        actions, key=lambda a: (_SUBJECT_ORDER[a.subject], a.name, a.kind, a.job_id or "")
    )
