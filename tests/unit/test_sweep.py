"""The sweep (pure): tagged jobs against replica, pilot and unit rows; tags; het offsets.

Examples; the properties over seeded random scenarios are in test_sweep_properties.py.
"""

from __future__ import annotations

import inspect
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from xhpc.broker.admit.tags import JobTag, TagKind, job_tag, pilot_tag, read_tag, unit_tag
from xhpc.broker.plan.pd_planner import het_offsets, plan_units
from xhpc.broker.watch import sweep as sweep_module
from xhpc.broker.watch.sweep import SweepAction, SweepKind, find_tagged, job_counts, plan_sweep
from xhpc.catalog import ResolvedModel
from xhpc.models import (
    EngineKind,
    JobInfo,
    PilotState,
    ReplicaState,
    ReplicaView,
    ServeRequest,
    UnitState,
)
from xhpc.records import PilotRecord, UnitRecord
from xhpc.settings import XhpcConfig
from xhpc.states import TERMINAL

S = ReplicaState
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
OLD = NOW - timedelta(minutes=5)
YOUNG = NOW - timedelta(seconds=5)
ME, BROKER = "alice", "b1"


def job(
    job_id: int,
    comment: str | None,
    state: str = "RUNNING",
    user: str | None = ME,
    het: tuple[int, int] | None = None,  # (leader, offset)
) -> JobInfo:
    return JobInfo(
        job_id=f"{het[0]}+{het[1]}" if het else str(job_id),
        raw_job_id=job_id,
        name="xhpc",
        state=state,
        user=user,
        comment=comment,
        het_job_id=het[0] if het else None,
        het_job_offset=het[1] if het else None,
    )


def rtag(rid: str, broker: str = BROKER, dep: str = "m") -> str:
    return job_tag(broker, dep, rid)


def row(
    rid: str,
    state: S = S.CREATING,
    job_id: str | None = None,
    at: datetime = OLD,
    pilot: str | None = None,
    unit: str | None = None,
    dep: str = "m",
) -> ReplicaView:
    return ReplicaView(
        replica_id=rid,
        deployment=dep,
        index=0,
        state=state,
        engine=EngineKind.VLLM,
        job_id=job_id,
        pilot=pilot,
        unit=unit,
        created_at=at,
        updated_at=at,
    )


def pilot(
    pid: str, state: PilotState = PilotState.PENDING, job_id: str | None = None, at: datetime = OLD
) -> PilotRecord:
    return PilotRecord(
        pilot_id=pid,
        node="n1",
        gpus=4,
        state=state,
        job_id=job_id,
        token_hash="h",
        pilot_dir="/p",
        created_at=at,
        updated_at=at,
    )


def unit(
    uid: str, state: UnitState = UnitState.STARTING, job_id: str | None = None, at: datetime = OLD
) -> UnitRecord:
    return UnitRecord(
        unit_id=uid,
        deployment="m",
        index=0,
        spec="1P1D",
        job_id=job_id,
        state=state,
        created_at=at,
        updated_at=at,
    )


def sweep(
    rows: list[ReplicaView] = [],  # noqa: B006 - never mutated
    jobs: list[JobInfo] = [],  # noqa: B006
    pilots: list[PilotRecord] = [],  # noqa: B006
    units: list[UnitRecord] = [],  # noqa: B006
) -> list[SweepAction]:
    return plan_sweep(BROKER, rows, pilots, units, jobs, now=NOW, user=ME)


def brief(actions: list[SweepAction]) -> list[tuple[str, str, str | None]]:
    return [(a.kind.value, a.name, a.job_id) for a in actions]


# -- tags -----------------------------------------------------------------------------------------


def test_every_tag_the_planner_writes_reads_back() -> None:
    assert read_tag(job_tag("b1", "m", "m-0")) == JobTag(
        kind=TagKind.REPLICA, broker="b1", deployment="m", name="m-0"
    )
    assert read_tag(pilot_tag("b1", "pilot-3")) == JobTag(
        kind=TagKind.PILOT, broker="b1", deployment=None, name="pilot-3"
    )
    assert read_tag(unit_tag("b1", "m", "m-u2")) == JobTag(
        kind=TagKind.UNIT, broker="b1", deployment="m", name="m-u2"
    )
    assert read_tag("xhpc:m:m-0") == JobTag(
        kind=TagKind.REPLICA, broker=None, deployment="m", name="m-0"
    )


@pytest.mark.parametrize(
    "comment",
    [
        None,
        "",
        "xhpc",
        "xhpc:b1:m:m-0 xhpc:b1:m:m-1",  # two tags in one comment
        "xhpc:b1:m:m-0\nxhpc:b1:m:m-1",
        "xhpc:b1:m:m-0;scancel -u alice",
        "xhpc-pilot:b1",
        "xhpc-pilot:b1:m:pilot-1",
        "xhpc-unit:b1:m-u0",
        "xhpc-unit:b1:m:m-u0:x",
        "xhpc-other:b1:m:m-0",
        "XHPC:b1:m:m-0",
        "xhpc:b1:../m:m-0",
        " xhpc:b1:m:m-0",
    ],
)
def test_a_comment_that_is_not_exactly_one_tag_is_none(comment: str | None) -> None:
    assert read_tag(comment) is None


# -- replicas -------------------------------------------------------------------------------------


def test_a_creating_replica_with_no_job_adopts_its_one_tagged_job() -> None:
    (act,) = sweep([row("m-0")], [job(7, rtag("m-0"), "PENDING")])
    assert (act.kind, act.subject, act.name, act.job_id) == (
        SweepKind.ADOPT,
        TagKind.REPLICA,
        "m-0",
        "7",
    )
    assert act.records == (("m-0", "7"),)


def test_of_several_tagged_jobs_the_oldest_is_adopted_and_the_others_cancelled() -> None:
    jobs = [job(9, rtag("m-0")), job(7, rtag("m-0")), job(8, rtag("m-0"), "PENDING")]
    assert brief(sweep([row("m-0")], jobs)) == [
        ("adopt", "m-0", "7"),
        ("cancel", "m-0", "8"),
        ("cancel", "m-0", "9"),
    ]


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_a_job_whose_replica_row_is_terminal_is_cancelled(state: S) -> None:
    (act,) = sweep([row("m-0", state, "7")], [job(7, rtag("m-0"))])
    assert (act.kind, act.job_id) == (SweepKind.CANCEL, "7")
    assert state.value in act.reason


def test_a_job_with_no_replica_row_is_cancelled_at_once() -> None:
    assert brief(sweep([], [job(5, rtag("ghost-0", dep="ghost"))])) == [("cancel", "ghost-0", "5")]


def test_a_second_job_for_a_replica_that_records_a_live_one_is_cancelled() -> None:
    rows = [row("m-0", S.READY, "7")]
    assert brief(sweep(rows, [job(7, rtag("m-0")), job(8, rtag("m-0"))])) == [
        ("cancel", "m-0", "8")
    ]


def test_a_job_its_live_row_does_not_record_is_cancelled() -> None:
    rows = [row("m-0", S.LOST, "7")]  # its recorded job has left squeue
    (act,) = sweep(rows, [job(8, rtag("m-0"))])
    assert (act.kind, act.job_id) == (SweepKind.CANCEL, "8") and "records job 7" in act.reason


def test_a_job_tagged_for_another_deployment_than_its_rows_is_cancelled() -> None:
    (act,) = sweep([row("m-0")], [job(8, rtag("m-0", dep="other"))])
    assert act.kind is SweepKind.CANCEL and "deployment m" in act.reason


def test_a_replica_tag_on_a_replica_of_a_pilot_takes_nothing() -> None:
    rows = [row("m-0", S.QUEUED, "3", pilot="pilot-1")]
    pilots = [pilot("pilot-1", PilotState.RUNNING, "3")]
    assert brief(sweep(rows, [job(8, rtag("m-0"))], pilots)) == [("cancel", "m-0", "8")]


def test_a_job_its_row_records_is_left_alone() -> None:
    assert sweep([row("m-0", S.READY, "7")], [job(7, rtag("m-0"))]) == []


@pytest.mark.parametrize(
    "rows",
    [
        [row("m-0", at=YOUNG)],
        [row("m-0", S.FAILED, at=YOUNG)],
        [row("m-0", S.READY, "7", at=YOUNG)],
    ],
    ids=["creating", "failed", "records-another"],
)
def test_rows_changed_within_the_grace_are_not_touched(rows: list[ReplicaView]) -> None:
    assert sweep(rows, [job(8, rtag("m-0"))]) == []


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "COMPLETING"])
def test_ended_and_ending_jobs_count_for_nothing(state: str) -> None:
    rows = [row("m-0"), row("m-1", S.FAILED), row("m-2", S.READY, "1")]
    jobs = [job(5, rtag("m-0"), state), job(6, rtag("m-1"), state), job(7, rtag("m-2"), state)]
    assert sweep(rows, jobs) == []
    assert not job_counts(jobs[0])


def test_other_brokers_and_other_users_jobs_are_never_touched() -> None:
    rows = [row("m-0"), row("m-1", S.FAILED)]
    jobs = [
        job(5, rtag("m-0", broker="b2")),
        job(6, rtag("m-1", broker="b2")),
        job(7, rtag("ghost-0", broker="b2", dep="ghost")),
        job(8, rtag("m-0"), user="mallory"),
        job(9, rtag("m-1"), user="mallory"),
        job(10, rtag("m-1"), user=None),
        job(11, "xhpc:m:m-1"),  # names no broker: left to `xhpc doctor`
        job(12, pilot_tag("b2", "pilot-1")),
        job(13, unit_tag("b2", "m", "m-u0")),
    ]
    assert sweep(rows, jobs) == []


def test_several_tags_in_one_comment_are_not_a_tag() -> None:
    comment = f"{rtag('m-0')} {rtag('m-1')}"
    assert sweep([row("m-0"), row("m-1", S.FAILED)], [job(5, comment)]) == []


# -- pilots ---------------------------------------------------------------------------------------


def test_a_phantom_pilot_ends_and_its_waiting_replicas_fail() -> None:
    rows = [
        row("m-0", S.QUEUED, pilot="pilot-1"),
        row("m-1", S.CREATING, pilot="pilot-1"),
        row("m-2", S.STOPPED, pilot="pilot-1"),
    ]
    (act,) = sweep(rows, [], [pilot("pilot-1")])
    assert (act.kind, act.name, act.fails) == (
        SweepKind.FAIL_PHANTOM_PILOT,
        "pilot-1",
        ("m-0", "m-1"),
    )


def test_a_young_phantom_pilot_and_its_young_replicas_are_left_alone() -> None:
    assert sweep([row("m-0", S.QUEUED, pilot="pilot-1")], [], [pilot("pilot-1", at=YOUNG)]) == []
    (act,) = sweep([row("m-0", S.QUEUED, pilot="pilot-1", at=YOUNG)], [], [pilot("pilot-1")])
    assert act.kind is SweepKind.FAIL_PHANTOM_PILOT and act.fails == ()


def test_a_pilot_with_no_job_adopts_its_tagged_job_for_its_waiting_replicas() -> None:
    rows = [row("m-0", S.QUEUED, pilot="pilot-1"), row("m-1", pilot="pilot-1")]
    jobs = [job(21, pilot_tag(BROKER, "pilot-1")), job(20, pilot_tag(BROKER, "pilot-1"))]
    adopt, cancel = sweep(rows, jobs, [pilot("pilot-1")])
    assert (adopt.kind, adopt.subject, adopt.job_id) == (SweepKind.ADOPT, TagKind.PILOT, "20")
    assert adopt.records == (("m-0", "20"), ("m-1", "20"))
    assert brief([cancel]) == [("cancel", "pilot-1", "21")]


@pytest.mark.parametrize("pilots", [[], [pilot("pilot-1", PilotState.ENDED, "4")]])
def test_a_pilot_job_whose_pilot_has_ended_or_is_missing_is_cancelled(
    pilots: list[PilotRecord],
) -> None:
    assert brief(sweep([], [job(20, pilot_tag(BROKER, "pilot-1"))], pilots)) == [
        ("cancel", "pilot-1", "20")
    ]


def test_waiting_replicas_of_a_pilot_with_a_job_take_it_and_of_an_ended_one_fail() -> None:
    rows = [row("m-0", S.QUEUED, pilot="pilot-1"), row("m-1", S.QUEUED, pilot="pilot-9")]
    actions = sweep(rows, [], [pilot("pilot-1", PilotState.RUNNING, "4")])
    assert brief(actions) == [("adopt", "m-0", "4"), ("fail-phantom-pilot", "pilot-9", None)]
    assert actions[1].fails == ("m-1",)


# -- PD units -------------------------------------------------------------------------------------


def _instances(uid: str = "m-u0", **kw: object) -> list[ReplicaView]:
    return [row(f"{uid}-p0", unit=uid, **kw), row(f"{uid}-d0", unit=uid, **kw)]  # type: ignore[arg-type]


def _hetjob(
    leader: int, uid: str = "m-u0", state: str = "PENDING", broker: str = BROKER
) -> list[JobInfo]:
    tag = unit_tag(broker, "m", uid)
    return [job(leader, tag, state, het=(leader, 0)), job(leader + 1, tag, state, het=(leader, 1))]


def test_a_unit_with_no_job_adopts_its_hetjob_and_each_instance_its_component() -> None:
    (act,) = sweep(_instances(), _hetjob(30), units=[unit("m-u0")])
    assert (act.kind, act.subject, act.job_id) == (SweepKind.ADOPT, TagKind.UNIT, "30")
    assert act.records == (("m-u0-d0", "30+1"), ("m-u0-p0", "30+0"))


def test_a_hetjob_of_an_ended_unit_is_cancelled_once_by_its_leader() -> None:
    units = [unit("m-u0", UnitState.ENDED, "30")]
    assert brief(sweep([], _hetjob(30), units=units)) == [("cancel", "m-u0", "30")]


def test_a_unit_whose_instances_no_longer_wait_does_not_adopt() -> None:
    rows = [row("m-u0-p0", S.FAILED, unit="m-u0"), row("m-u0-d0", unit="m-u0")]
    (act,) = sweep(rows, _hetjob(30), units=[unit("m-u0")])
    assert (act.kind, act.job_id) == (SweepKind.CANCEL, "30")


def test_waiting_instances_of_a_unit_with_a_job_take_their_components() -> None:
    rows = [row("m-u0-p0", S.QUEUED, "30+0", unit="m-u0"), row("m-u0-d0", unit="m-u0")]
    assert brief(sweep(rows, [], units=[unit("m-u0", job_id="30")])) == [
        ("adopt", "m-u0-d0", "30+1")
    ]


def test_het_offsets_agree_with_the_planner(tmp_path: Path) -> None:
    config = XhpcConfig(state_dir=tmp_path)
    model = ResolvedModel(name="m", path=tmp_path, served_name="m")
    req = ServeRequest(model="m", replicas=2, pd="3P2D", engine=EngineKind.VLLM)
    plan = plan_units(
        req, model, config, start_index=0, agent_python="/usr/bin/python3", broker_id="b"
    )
    for u in plan.jobs:
        offsets = het_offsets(u.key, [i.replica_id for i in reversed(u.hosts)])
        assert offsets == {i.replica_id: i.spec.het_offset for i in u.hosts}


@pytest.mark.parametrize(
    "names",
    [
        ["u-p0", "u-p2"],  # a gap
        ["u-p0", "u-p0"],
        ["u-p0", "v-d0"],  # another unit's
        ["u-x0"],
        ["u-p0-d0"],
        ["u-p01", "u-p1"],
    ],
)
def test_het_offsets_refuse_names_the_planner_never_writes(names: list[str]) -> None:
    assert het_offsets("u", names) is None


# -- find_tagged (the launcher's look-up) ---------------------------------------------------------


def test_find_tagged_returns_this_users_live_jobs_of_exactly_that_tag_oldest_first() -> None:
    tag = rtag("m-0")
    jobs = [
        job(9, tag),
        job(3, tag, "PENDING"),
        job(4, tag, "CANCELLED"),
        job(5, tag, user="mallory"),
        job(6, tag + "x"),
        job(7, rtag("m-1")),
        *_hetjob(40, "m-u0"),
    ]
    assert find_tagged(jobs, tag, ME) == ["3", "9"]
    assert find_tagged(jobs, unit_tag(BROKER, "m", "m-u0"), ME) == ["40"]
    assert find_tagged(jobs, tag, None) == ["3", "5", "9"]


def test_the_stranded_replica_rule_asks_the_hosting_kind_and_never_names_one() -> None:
    """Job-less replicas of a hosting job are judged by one rule; what they take (or whether
    they fail) is their kind's to say, so a new kind of hosting job is one more entry."""
    assert set(sweep_module._HOST_OF) == set(TagKind) - {TagKind.REPLICA}
    source = inspect.getsource(sweep_module._stranded)
    assert "TagKind." not in source and "pilot" not in source.lower()
