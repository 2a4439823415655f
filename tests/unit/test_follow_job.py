"""One judge of a hosting job's Slurm job, whatever its kind
(xhpc.broker.watch.reconcile.follow_job)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from xhpc.broker.watch.reconcile import VANISH_GRACE, JobMove, follow_job
from xhpc.models import JobInfo, JobKind, JobState
from xhpc.records import JobRecord

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _job(kind: JobKind, state: JobState, job_id: str | None = "7") -> JobRecord:
    return JobRecord(key="k", kind=kind, state=state, job_id=job_id, created_at=T0, updated_at=T0)


def _info(state: str) -> JobInfo:
    return JobInfo(job_id="7", raw_job_id=7, name="x", state=state, user="u", comment="")


def test_a_job_slurm_ended_ends_its_row_whatever_its_kind() -> None:
    for kind, state in ((JobKind.PILOT, JobState.RUNNING), (JobKind.UNIT, JobState.READY)):
        assert follow_job(_job(kind, state), _info("TIMEOUT"), T0) == JobMove(
            JobState.ENDED, "job TIMEOUT"
        )


def test_a_job_gone_from_squeue_ends_only_after_the_grace() -> None:
    pilot = _job(JobKind.PILOT, JobState.PENDING)
    assert follow_job(pilot, None, T0 + VANISH_GRACE / 2) is None
    late = T0 + VANISH_GRACE + timedelta(seconds=1)
    assert follow_job(pilot, None, late) == JobMove(JobState.ENDED, "job no longer in squeue")
    assert follow_job(_job(JobKind.PILOT, JobState.PENDING, job_id=None), None, late) is None


def test_a_pilot_follows_its_job_between_the_queue_and_running() -> None:
    assert follow_job(_job(JobKind.PILOT, JobState.PENDING), _info("RUNNING"), T0) == JobMove(
        JobState.RUNNING, None
    )
    requeued = follow_job(_job(JobKind.PILOT, JobState.RUNNING), _info("NODE_FAIL"), T0)
    assert requeued == JobMove(JobState.PENDING, "job NODE_FAIL")
    assert follow_job(_job(JobKind.PILOT, JobState.RUNNING), _info("SUSPENDED"), T0) is None


def test_a_unit_state_sums_up_its_instances_not_its_job_queue_state() -> None:
    assert follow_job(_job(JobKind.UNIT, JobState.STARTING), _info("RUNNING"), T0) is None
    assert follow_job(_job(JobKind.UNIT, JobState.READY), _info("PENDING"), T0) is None
