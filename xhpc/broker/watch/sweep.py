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

One judge (``_tagged``) rules on every tag, whatever the kind of row it names: a kind only says
what its row records, whether it may take a job, and the id each of its replicas records then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from xhpc.broker.admit.tags import JobTag, TagKind, read_tag
from xhpc.broker.plan.pd_planner import het_offsets
from xhpc.broker.watch.reconcile import ENDED_STATES
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


@dataclass(frozen=True)
class _Owner:
    """The row a tag names, as the one judge sees it whatever its kind: the job it records,
    why it accounts for no job (``gone``), whether it may take one, and the id each of its
    replicas records if it does (``records``: a replica and its hetjob offset, or None)."""

    recorded: str | None = None
    gone: str | None = None
    can_adopt: bool = False
    records: tuple[tuple[str, int | None], ...] = ()
    why: str = ""


def _replica_owner(tag: JobTag, w: _World) -> _Owner | None:
    row = w.rows.get(tag.name)
    if row is None:
        return _Owner(gone="no replica row")
    if w.young(row.updated_at):
        return None
    gone: str | None = None
    if row.state in TERMINAL:
        gone = f"its replica row is {row.state.value}"
    elif row.deployment != tag.deployment:
        gone = f"its replica row belongs to deployment {row.deployment}"
    elif row.pilot is not None or row.unit is not None:
        gone = "its replica runs in a pilot or unit job, not its own"
    return _Owner(
        recorded=row.job_id,
        gone=gone,
        can_adopt=row.state is S.CREATING,
        records=((tag.name, None),),
        why="its job was submitted but never recorded",
    )


def _pilot_owner(tag: JobTag, w: _World) -> _Owner | None:
    pilot = w.pilots.get(tag.name)
    if pilot is None:
        return _Owner(gone="no live pilot row")
    if w.young(pilot.updated_at):
        return None
    members = w.members(pilot=tag.name)
    waiting = [r.replica_id for r in members if _jobless(r) and not w.young(r.updated_at)]
    return _Owner(
        recorded=pilot.job_id,
        gone="its pilot row has ENDED" if pilot.state is PilotState.ENDED else None,
        can_adopt=pilot.state in _LIVE_PILOT,
        records=tuple((rid, None) for rid in waiting),
        why="the pilot's job was submitted but never recorded",
    )


def _unit_offsets(unit: UnitRecord, w: _World) -> dict[str, int] | None:
    """The instances' components, when every instance still waits for the unit's job."""
    instances = w.members(unit=unit.unit_id)
    if not instances or not all(r.job_id is None and r.state is S.CREATING for r in instances):
        return None
    return het_offsets(unit.unit_id, [r.replica_id for r in instances])


def _unit_owner(tag: JobTag, w: _World) -> _Owner | None:
    unit = w.units.get(tag.name)
    if unit is None:
        return _Owner(gone="no live unit row")
    if w.young(unit.updated_at):
        return None
    gone: str | None = None
    if unit.state is UnitState.ENDED:
        gone = "its unit row has ENDED"
    elif unit.deployment != tag.deployment:
        gone = f"its unit row belongs to deployment {unit.deployment}"
    offsets = _unit_offsets(unit, w) or {}
    return _Owner(
        recorded=unit.job_id,
        gone=gone,
        can_adopt=unit.state is UnitState.STARTING and bool(offsets),
        records=tuple(sorted(offsets.items())),
        why="the unit's hetjob was submitted but never recorded",
    )


_OWNER_OF = {
    TagKind.REPLICA: _replica_owner,
    TagKind.PILOT: _pilot_owner,
    TagKind.UNIT: _unit_owner,
}


def _recorded_id(job: str, offset: int | None) -> str:
    """The id a replica records of job ``job``: a hetjob component's is ``JOB+OFFSET``."""
    return job if offset is None else f"{job}+{offset}"


def _tagged(tag: JobTag, found: list[_Found], w: _World) -> list[SweepAction]:
    """The one judge: the tagged jobs of one row, whatever its kind (never two jobs for a row,
    never a job without a live row; a row that records none and may take one adopts the
    oldest)."""
    owner = _OWNER_OF[tag.kind](tag, w)
    if owner is None:
        return []  # changed within the grace: the squeue view may predate the change
    verdict = _judge(found, owner.recorded, owner.can_adopt, owner.gone)
    actions = _cancels(verdict, tag.kind, tag.name)
    if verdict.adopt is not None:
        job = verdict.adopt.key
        actions.append(
            SweepAction(
                kind=SweepKind.ADOPT,
                subject=tag.kind,
                name=tag.name,
                job_id=job,
                records=tuple((rid, _recorded_id(job, k)) for rid, k in owner.records),
                reason=owner.why,
            )
        )
    return actions


def _phantom_pilots(w: _World, adopted: set[str]) -> list[SweepAction]:
    """Pilots with no job that adopt none: phantoms (their tagged jobs, if any, are cancelled);
    their job-less replicas fail with them."""
    actions: list[SweepAction] = []
    for pilot in w.pilots.values():
        if pilot.pilot_id in adopted or pilot.job_id is not None or w.young(pilot.updated_at):
            continue
        if pilot.state is PilotState.ENDED:
            continue
        members = w.members(pilot=pilot.pilot_id)
        waiting = tuple(r.replica_id for r in members if _jobless(r) and not w.young(r.updated_at))
        why = "pilot never submitted: no job recorded, none it can take"
        actions.append(_fail(pilot.pilot_id, waiting, why))
    return actions


@dataclass(frozen=True)
class _Host:
    """A hosting job as its job-less replicas see it, whatever its kind: the job it records and
    the hetjob offset each replica takes of it (None: the job's own id), or why its waiting
    replicas fail instead (``ended``)."""

    job_id: str | None = None
    offsets: dict[str, int | None] = field(default_factory=dict)
    ended: str | None = None


def _pilot_host(key: str, members: list[ReplicaView], w: _World) -> _Host:
    """A pilot's replicas take its job as it is; an ended (or missing) pilot fails them."""
    pilot = w.pilots.get(key)
    if pilot is None or pilot.state is PilotState.ENDED:
        return _Host(ended="its pilot has ended")
    return _Host(job_id=pilot.job_id, offsets=dict.fromkeys(r.replica_id for r in members))


def _unit_host(key: str, members: list[ReplicaView], w: _World) -> _Host:
    """A unit's instances take their components (``JOB+N``); an ended unit's are its own
    desk's to end."""
    unit = w.units.get(key)
    offsets = het_offsets(key, [r.replica_id for r in members]) or {}
    return _Host(job_id=unit.job_id if unit is not None else None, offsets=dict(offsets))


_HOST_OF = {TagKind.PILOT: _pilot_host, TagKind.UNIT: _unit_host}


def _stranded(w: _World, settled: dict[TagKind, set[str]]) -> list[SweepAction]:
    """Job-less replicas of a job that has one take theirs, as its kind says (``_HOST_OF``);
    those of a job that has ended fail, when its kind says so."""
    actions: list[SweepAction] = []
    for (kind, key), members in sorted(w.groups.items()):
        if key in settled[kind]:
            continue
        waiting = sorted(r.replica_id for r in members if _jobless(r) and not w.young(r.updated_at))
        if not waiting:
            continue
        host = _HOST_OF[kind](key, members, w)
        if host.ended is not None:
            actions.append(_fail(key, tuple(waiting), host.ended))
            continue
        job_id = host.job_id
        if job_id is None:
            continue
        actions += [
            _take(rid, _recorded_id(job_id, host.offsets[rid]), kind.value)
            for rid in waiting
            if rid in host.offsets
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
    actions: list[SweepAction] = []
    groups = _groups(jobs, broker_id, user)
    for tag in sorted(groups, key=lambda t: (t.kind, t.name, t.deployment or "")):
        actions += _tagged(tag, groups[tag], w)
    adopted = {
        kind: {a.name for a in actions if a.kind is SweepKind.ADOPT and a.subject is kind}
        for kind in (TagKind.PILOT, TagKind.UNIT)
    }
    phantoms = _phantom_pilots(w, adopted[TagKind.PILOT])
    settled = {**adopted, TagKind.PILOT: adopted[TagKind.PILOT] | {a.name for a in phantoms}}
    actions += phantoms + _stranded(w, settled)
    return sorted(
        actions, key=lambda a: (_SUBJECT_ORDER[a.subject], a.name, a.kind, a.job_id or "")
    )
