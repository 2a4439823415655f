"""Reconcile diff: replicas + Slurm's job view -> actions (pure, no store, no Slurm). Replicas
are written as their rows and seen as the store shows them (``replica_record``)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from xhpc.broker.watch.reconcile import CREATING_GRACE, VANISH_GRACE, Action, observe
from xhpc.models import JobInfo
from xhpc.models import ReplicaState as S
from xhpc.slurm.parse import parse_squeue_json
from xhpc.store import replica_record
from xhpc.store.tables import ReplicaRow

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
STALE_BEFORE = NOW - timedelta(seconds=20)


def row(state: S, job_id: str | None = "10", *, age_s: float = 0.0, **kw: Any) -> ReplicaRow:
    when = NOW - timedelta(seconds=age_s)
    fields: dict[str, Any] = {
        "replica_id": "m-0",
        "deployment": "m",
        "idx": 0,
        "state": state.value,
        "engine": "vllm",
        "job_id": job_id,
        "created_at": when,
        "updated_at": when,
        **kw,
    }
    return ReplicaRow(**fields)


def job(state: str, job_id: str = "10", **kw: Any) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        raw_job_id=int(job_id.split("_")[0].split("+")[0]),
        name="x",
        state=state,
        **kw,
    )


def run(rows: list[ReplicaRow], jobs: list[JobInfo]) -> list[Action]:
    views = [replica_record(r) for r in rows]
    return observe(views, {j.job_id: j for j in jobs}, stale_before=STALE_BEFORE, now=NOW)


def one(rows: list[ReplicaRow], jobs: list[JobInfo]) -> Action:
    (action,) = run(rows, jobs)
    return action


# -- pending --------------------------------------------------------------------------------------
def test_pending_job_keeps_queued_and_records_reason() -> None:
    act = one([row(S.QUEUED, reason="submitted")], [job("PENDING", reason="Resources")])
    assert (act.replica_id, act.target, act.reason) == ("m-0", S.QUEUED, "Resources")
    assert act.job_update.given() == {"slurm_state": "PENDING", "reason": "Resources"}


def test_pending_without_reason_says_pending() -> None:
    assert one([row(S.QUEUED, reason="submitted")], [job("PENDING")]).reason == "Pending"


def test_pending_with_unchanged_reason_is_quiet() -> None:
    assert run([row(S.QUEUED, reason="Priority")], [job("PENDING", reason="Priority")]) == []


def test_pending_from_captured_squeue_output(slurm_output: Callable[[str], str]) -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(slurm_output("squeue-mixed.json"))}
    acts = observe(
        [replica_record(row(S.QUEUED, job_id="6", reason="submitted"))],
        jobs,
        stale_before=STALE_BEFORE,
        now=NOW,
    )
    assert [(a.target, a.reason) for a in acts] == [(S.QUEUED, "Resources")]


# -- running --------------------------------------------------------------------------------------
def test_running_job_moves_queued_to_starting_with_node_and_gpus() -> None:
    running = job(
        "RUNNING", batch_host="n2", nodes="n2", gpus_idx=(0, 2), gres_detail=("gpu:2(IDX:0,2)",)
    )
    act = one([row(S.QUEUED)], [running])
    assert (act.target, act.reason) == (S.STARTING, "job running")
    assert act.change.given() == {"node": "n2", "gpus": (0, 2)}
    assert act.job_update.given()["node"] == "n2"
    assert act.job_update.given()["gres_detail"] == "gpu:2(IDX:0,2)"


def test_running_from_captured_squeue_output(slurm_output: Callable[[str], str]) -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(slurm_output("squeue-mixed.json"))}
    rows = [row(S.QUEUED, job_id="1"), row(S.QUEUED, job_id="3+1", replica_id="m-1", idx=1)]
    views = [replica_record(r) for r in rows]
    acts = {a.replica_id: a for a in observe(views, jobs, stale_before=STALE_BEFORE, now=NOW)}
    assert acts["m-0"].target is S.STARTING
    assert acts["m-0"].change.given().items() >= {"node": "n1", "gpus": (0, 1)}.items()
    assert acts["m-1"].change.given().items() >= {"node": "n3", "gpus": (0,)}.items()
    # The job's end (start + time limit) is what walltime handover plans by.
    started = jobs["1"].start_time
    assert started is not None and jobs["1"].time_limit_min
    assert acts["m-0"].change.given()["ends_at"] == started + timedelta(
        minutes=jobs["1"].time_limit_min
    )


def test_running_without_gres_detail_leaves_gpus_alone() -> None:
    act = one([row(S.QUEUED)], [job("RUNNING", batch_host="n1")])
    assert act.change.given() == {"node": "n1"}


def test_running_and_known_is_quiet() -> None:
    r = row(S.STARTING, node="n1", gpus="0,1")
    assert run([r], [job("RUNNING", batch_host="n1", gpus_idx=(0, 1))]) == []


def test_running_on_changed_node_updates_fields_without_transition() -> None:
    r = row(S.STARTING, node="n1", gpus="0")
    act = one([r], [job("RUNNING", batch_host="n3", gpus_idx=(1,))])
    assert act.target is None
    assert act.change.given() == {"node": "n3", "gpus": (1,)}


def test_ready_with_stale_heartbeat_is_lost() -> None:
    r = row(S.READY, node="n1", last_heartbeat=STALE_BEFORE - timedelta(seconds=1))
    act = one([r], [job("RUNNING", batch_host="n1")])
    assert (act.target, act.reason) == (S.LOST, "agent heartbeat stale")


def test_ready_with_naive_stale_heartbeat_is_lost() -> None:
    """SQLite hands back naive datetimes; they are UTC."""
    naive = (STALE_BEFORE - timedelta(seconds=5)).replace(tzinfo=None)
    act = one([row(S.READY, node="n1", last_heartbeat=naive)], [job("RUNNING", batch_host="n1")])
    assert act.target is S.LOST


def test_ready_with_fresh_heartbeat_is_quiet() -> None:
    r = row(S.READY, node="n1", last_heartbeat=NOW - timedelta(seconds=1))
    assert run([r], [job("RUNNING", batch_host="n1")]) == []


# -- ended ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slurm_state",
    ["COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "FAILED", "OUT_OF_MEMORY", "PREEMPTED"],
)
def test_ended_job_while_draining_is_stopped(slurm_state: str) -> None:
    act = one([row(S.DRAINING)], [job(slurm_state)])
    assert (act.target, act.reason) == (S.STOPPED, f"job {slurm_state}")
    assert act.job_update.given()["ended_at"] == NOW


@pytest.mark.parametrize("state", [S.QUEUED, S.STARTING, S.READY, S.LOST])
@pytest.mark.parametrize("slurm_state", ["COMPLETED", "CANCELLED", "FAILED", "OUT_OF_MEMORY"])
def test_ended_job_otherwise_is_failed(state: S, slurm_state: str) -> None:
    act = one([row(state)], [job(slurm_state)])
    assert (act.target, act.reason) == (S.FAILED, f"job {slurm_state}")


# -- requeue, preemption, node failure ------------------------------------------------------------
@pytest.mark.parametrize("state", [S.STARTING, S.READY, S.LOST])
@pytest.mark.parametrize(
    "slurm_state", ["PENDING", "REQUEUED", "COMPLETING", "NODE_FAIL", "PREEMPTED"]
)
def test_a_job_that_leaves_running_takes_its_replica_off_the_node(
    state: S, slurm_state: str
) -> None:
    r = row(state, node="n1", host="10.77.0.11", port=9000)
    act = one([r], [job(slurm_state, reason="BeginTime")])
    assert act.target is S.QUEUED and slurm_state in str(act.reason)
    # The old address is never routed to again; the job's next run must register anew.
    assert act.change.given()["host"] is None and act.change.given()["port"] is None
    assert act.change.given()["restarts"] == r.restarts + 1


def test_a_requeued_job_seen_with_its_restart_count_sets_the_runs_expected() -> None:
    act = one([row(S.READY, node="n1")], [job("PENDING", restart_count=3)])
    assert act.change.given()["restarts"] == 3


def test_a_queued_replica_whose_job_failed_its_node_waits_for_the_requeue() -> None:
    assert run([row(S.QUEUED)], [job("NODE_FAIL")]) == []


def test_a_running_job_teaches_the_restart_count() -> None:
    act = one([row(S.STARTING, node="n1")], [job("RUNNING", batch_host="n1", restart_count=2)])
    assert act.change.given()["restarts"] == 2


# -- vanished -------------------------------------------------------------------------------------
def test_vanished_job_is_lost_after_grace() -> None:
    late = VANISH_GRACE.total_seconds() + 1
    act = one([row(S.READY, age_s=late)], [])
    assert (act.target, act.reason) == (S.LOST, "job no longer in squeue")
    assert act.job_update.given() == {"ended_at": NOW}  # its job row is closed, state unknown


def test_vanished_job_within_grace_is_quiet() -> None:
    assert run([row(S.QUEUED, age_s=VANISH_GRACE.total_seconds() - 1)], []) == []


def test_vanished_while_draining_is_stopped() -> None:
    act = one([row(S.DRAINING)], [])
    assert (act.target, act.job_update.given()) == (S.STOPPED, {"ended_at": NOW})


def test_vanished_and_already_lost_is_quiet() -> None:
    assert run([row(S.LOST, age_s=3600)], []) == []


# -- never submitted ------------------------------------------------------------------------------
def test_creating_without_job_for_long_is_failed() -> None:
    act = one([row(S.CREATING, job_id=None, age_s=CREATING_GRACE.total_seconds() + 1)], [])
    assert (act.target, act.reason) == (S.FAILED, "never submitted")


def test_creating_without_job_recently_is_quiet() -> None:
    assert run([row(S.CREATING, job_id=None, age_s=5)], []) == []


def test_each_row_is_judged_on_its_own() -> None:
    rows = [
        row(S.QUEUED, job_id="1", replica_id="m-0"),
        row(S.DRAINING, job_id="2", replica_id="m-1", idx=1),
        row(S.READY, job_id="3", replica_id="m-2", idx=2, age_s=60),
        row(S.CREATING, job_id=None, replica_id="m-3", idx=3, age_s=600),
    ]
    acts = run(rows, [job("RUNNING", "1", batch_host="n1"), job("CANCELLED", "2")])
    assert [(a.replica_id, a.target) for a in acts] == [
        ("m-0", S.STARTING),
        ("m-1", S.STOPPED),
        ("m-2", S.LOST),
        ("m-3", S.FAILED),
    ]


@pytest.mark.parametrize("slurm_state", ["SUSPENDED", "STOPPED"])
def test_a_paused_job_leaves_routing_but_keeps_its_run(slurm_state: str) -> None:
    act = one([row(S.READY, node="n1", host="h", port=1)], [job(slurm_state)])
    assert act.target is S.QUEUED and act.change.given()["host"] is None
    assert "restarts" not in act.change.given()  # the same run resumes: its agent goes on


@pytest.mark.parametrize("slurm_state", ["NODE_FAIL", "PREEMPTED"])
def test_jobs_slurm_does_not_requeue_end_there(slurm_state: str) -> None:
    pd = row(S.READY, node="n1", pd_unit="m-u0", pd_role="prefill")
    assert one([pd], [job(slurm_state)]).target is S.FAILED


@pytest.mark.parametrize("slurm_state", ["NODE_FAIL", "PREEMPTED", "PENDING"])
def test_a_requeued_pilot_takes_its_replicas_back_to_the_queue(slurm_state: str) -> None:
    pilot = row(S.READY, node="n1", host="h", port=1, pilot_id="p0")
    act = one([pilot], [job(slurm_state)])
    assert act.target is S.QUEUED and act.change.given()["host"] is None
    assert act.change.given()["restarts"] == 1  # only the pilot's next run may run it again


@pytest.mark.parametrize("state", [S.STARTING, S.READY])
def test_a_job_at_its_time_limit_ended_as_planned(state: S) -> None:
    act = one([row(state)], [job("TIMEOUT")])
    assert (act.target, act.reason) == (S.STOPPED, "job TIMEOUT")


def test_a_configuring_job_takes_the_run_slurm_counts() -> None:
    act = one([row(S.READY, node="n1", restarts=1)], [job("CONFIGURING", restart_count=2)])
    assert act.target is S.QUEUED and act.change.given()["restarts"] == 2
