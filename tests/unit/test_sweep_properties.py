"""The sweep's properties over seeded random scenarios: whatever the rows and the queue, after
the planned actions no replica, pilot or unit has two jobs, no job of this broker runs without a
live row recording it, and nothing of another broker or user is touched.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tests.unit.test_sweep import (
    BROKER,
    ME,
    NOW,
    OLD,
    YOUNG,
    S,
    _hetjob,
    _instances,
    job,
    pilot,
    row,
    sweep,
    unit,
)
from xhpc.broker.admit.tags import JobTag, TagKind, job_tag, pilot_tag, read_tag
from xhpc.broker.watch.sweep import SweepAction, SweepKind, job_counts
from xhpc.models import JobInfo, PilotState, ReplicaView, UnitState
from xhpc.records import PilotRecord, UnitRecord

# -- properties -----------------------------------------------------------------------------------

JOB_STATES = ["PENDING", "RUNNING", "COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"]
PILOT_STATES = [PilotState.PENDING] * 3 + list(PilotState)  # mostly where a launch leaves it
UNIT_STATES = [UnitState.STARTING] * 3 + list(UnitState)


@dataclass
class World:
    rows: list[ReplicaView] = field(default_factory=list)
    pilots: list[PilotRecord] = field(default_factory=list)
    units: list[UnitRecord] = field(default_factory=list)
    jobs: list[JobInfo] = field(default_factory=list)


def _at(rng: random.Random) -> datetime:
    return rng.choice([OLD, OLD, YOUNG])


def _maybe_job(rng: random.Random) -> str | None:
    return rng.choice([None, None, str(rng.randint(1, 60))])


def _rows(rng: random.Random, w: World) -> None:
    for i in range(rng.randint(0, 3)):
        w.pilots.append(pilot(f"pilot-{i}", rng.choice(PILOT_STATES), _maybe_job(rng), _at(rng)))
    for i in range(rng.randint(0, 2)):
        uid = f"m-u{i}"
        w.units.append(unit(uid, rng.choice(UNIT_STATES), _maybe_job(rng), _at(rng)))
        state = rng.choice([S.CREATING, S.CREATING, S.CREATING, S.QUEUED, S.FAILED])
        w.rows += _instances(uid, state=state, at=_at(rng))
    for i in range(rng.randint(0, 6)):
        in_pilot = rng.choice([None, None, "pilot-0", "pilot-1"])
        w.rows.append(row(f"m-{i}", rng.choice(list(S)), _maybe_job(rng), _at(rng), pilot=in_pilot))


def _jobs(rng: random.Random, w: World) -> None:
    names = [f"m-{i}" for i in range(8)]
    for raw in rng.sample(range(1, 60), rng.randint(0, 10)):
        broker = rng.choice([BROKER, BROKER, BROKER, "b2"])
        comment = rng.choice(
            [
                job_tag(broker, "m", rng.choice(names)),
                job_tag(broker, "ghost", "ghost-0"),
                pilot_tag(broker, f"pilot-{rng.randint(0, 3)}"),
                "xhpc:m:m-0",
                None,
                "not-a-tag",
            ]
        )
        user = rng.choice([ME, ME, ME, "mallory"])
        w.jobs.append(job(raw, comment, rng.choice(JOB_STATES), user))
    if rng.random() < 0.5:  # a hetjob of a unit
        leader = rng.randint(100, 200)
        uid, broker = f"m-u{rng.randint(0, 2)}", rng.choice([BROKER, "b2"])
        w.jobs += _hetjob(leader, uid, rng.choice(JOB_STATES), broker)


def scenario(seed: int) -> World:
    rng = random.Random(seed)
    w = World()
    _rows(rng, w)
    _jobs(rng, w)
    return w


def _ours(j: JobInfo) -> JobTag | None:
    tag = read_tag(j.comment)
    if tag is None or tag.broker != BROKER or j.user != ME or not job_counts(j):
        return None
    return tag


def _key(j: JobInfo) -> str:
    return str(j.het_job_id) if j.het_job_id is not None else j.job_id


def _young(at: datetime) -> bool:
    return NOW - at < timedelta(seconds=30)


Row = ReplicaView | PilotRecord | UnitRecord
ENDED_ROW = {S.FAILED, S.STOPPED, PilotState.ENDED, UnitState.ENDED}


@dataclass
class After:
    """The world once the planned actions are applied."""

    rows: dict[tuple[TagKind, str], Row]
    jobs: dict[tuple[TagKind, str], str | None]  # what each row records
    cancelled: set[str]

    @classmethod
    def of(cls, w: World, actions: list[SweepAction]) -> After:
        rows: dict[tuple[TagKind, str], Row] = {(TagKind.REPLICA, r.replica_id): r for r in w.rows}
        rows |= {(TagKind.PILOT, p.pilot_id): p for p in w.pilots}
        rows |= {(TagKind.UNIT, u.unit_id): u for u in w.units}
        jobs = {k: v.job_id for k, v in rows.items()}
        for a in actions:
            if a.kind is SweepKind.ADOPT:
                jobs[(a.subject, a.name)] = a.job_id
                jobs |= {(TagKind.REPLICA, rid): job_id for rid, job_id in a.records}
        cancelled = {str(a.job_id) for a in actions if a.kind is SweepKind.CANCEL}
        return cls(rows, jobs, cancelled)


SEEDS = range(400)


def each_seed(check: Callable[[int], None], seeds: Iterable[int] = SEEDS) -> None:
    """Run ``check`` on every seed's scenario; a failure names its seed (to replay it)."""
    for seed in seeds:
        try:
            check(seed)
        except AssertionError as err:
            raise AssertionError(f"seed {seed}: {err}") from err


def test_property_only_this_brokers_live_jobs_of_this_user_are_acted_on() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        actions = sweep(w.rows, w.jobs, w.pilots, w.units)
        ours = {_key(j) for j in w.jobs if _ours(j) is not None}
        every: list[Row] = [*w.rows, *w.pilots, *w.units]
        recorded = {str(x.job_id) for x in every if x.job_id is not None}
        for act in actions:
            if act.kind is SweepKind.CANCEL:
                assert act.job_id in ours
            if act.kind is SweepKind.ADOPT:
                base = str(act.job_id).split("+")[0]
                assert act.job_id in ours or base in recorded

    each_seed(check)


def test_property_no_job_is_both_adopted_and_cancelled_nor_cancelled_twice() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        actions = sweep(w.rows, w.jobs, w.pilots, w.units)
        cancels = [a.job_id for a in actions if a.kind is SweepKind.CANCEL]
        adopted = {a.job_id for a in actions if a.kind is SweepKind.ADOPT}
        assert len(cancels) == len(set(cancels)) and not adopted & set(cancels)

    each_seed(check)


def test_property_after_the_sweep_every_live_job_has_its_live_row_recording_it() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        after = After.of(w, sweep(w.rows, w.jobs, w.pilots, w.units))
        for j in w.jobs:
            tag = _ours(j)
            if tag is None or _key(j) in after.cancelled:
                continue
            owner = after.rows.get((tag.kind, tag.name))
            assert owner is not None, f"job {j.job_id} runs with no row"
            if _young(owner.updated_at):
                continue  # not judged yet
            assert owner.state not in ENDED_ROW, f"job {j.job_id} runs for an ended row"
            recorded = after.jobs[(tag.kind, tag.name)]
            assert recorded == _key(j), f"job {j.job_id} is not the one its row records"

    each_seed(check)


def test_property_no_phantom_pilot_survives_the_grace() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        actions = sweep(w.rows, w.jobs, w.pilots, w.units)
        failed = {a.name for a in actions if a.kind is SweepKind.FAIL_PHANTOM_PILOT}
        after = After.of(w, actions)
        for p in w.pilots:
            if p.state is PilotState.ENDED or _young(p.updated_at):
                continue
            has_job = after.jobs[(TagKind.PILOT, p.pilot_id)] is not None
            assert has_job or p.pilot_id in failed, f"{p.pilot_id} is a phantom"

    each_seed(check)


def test_property_young_replica_rows_are_never_failed_nor_given_a_job() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        young = {r.replica_id for r in w.rows if _young(r.updated_at)}
        for act in sweep(w.rows, w.jobs, w.pilots, w.units):
            assert not young & set(act.fails)
            if act.subject is not TagKind.UNIT:  # a unit's instances are adopted with it, whole
                assert not young & {rid for rid, _ in act.records}

    each_seed(check)


def test_property_the_plan_does_not_depend_on_the_order_of_its_inputs() -> None:
    def check(seed: int) -> None:
        w = scenario(seed)
        rng = random.Random(seed)
        rows, jobs, pilots, units = list(w.rows), list(w.jobs), list(w.pilots), list(w.units)
        for x in (rows, jobs, pilots, units):
            rng.shuffle(x)
        assert sweep(w.rows, w.jobs, w.pilots, w.units) == sweep(rows, jobs, pilots, units)

    each_seed(check, range(100))
