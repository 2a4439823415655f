"""Typed store changes: a change sets what it names, and nothing else."""

from __future__ import annotations

from datetime import UTC, datetime

from xhpc.changes import NO_CHANGE, OFF_NODE, JobRunChange, ReplicaChange, heartbeat

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_change_gives_only_the_fields_it_was_given_even_when_they_are_none() -> None:
    assert ReplicaChange(host=None, port=8000).given() == {"host": None, "port": 8000}
    assert OFF_NODE.given() == {"ends_at": None, "host": None, "last_heartbeat": None, "port": None}
    assert NO_CHANGE.given() == {} and not NO_CHANGE


def test_a_later_change_wins_where_both_set_a_field() -> None:
    both = OFF_NODE.then(ReplicaChange(port=1, restarts=2))
    assert both.given()["port"] == 1 and both.given()["restarts"] == 2
    assert both.given()["host"] is None


def test_a_heartbeat_sets_the_time_and_a_note_only_when_given() -> None:
    assert heartbeat(T0).given() == {"last_heartbeat": T0}
    assert heartbeat(T0, "late").given() == {"last_heartbeat": T0, "reason": "late"}


def test_a_job_run_change_ending_a_run_keeps_what_slurm_said() -> None:
    said = JobRunChange(slurm_state="NODE_FAIL", reason=None)
    assert said.then(JobRunChange(ended_at=T0)).given() == {
        "ended_at": T0,
        "reason": None,
        "slurm_state": "NODE_FAIL",
    }
