"""Which queued replicas are due for a re-plan."""

from __future__ import annotations

from datetime import timedelta

from xhpc.broker.plan.replan import replan_due, stuck_on_node
from xhpc.clock import utcnow
from xhpc.models import JobInfo, ReplicaView
from xhpc.store import ReplicaRow, replica_record

NOW = utcnow()


def row(
    rid: str, job: str, *, state: str = "QUEUED", placed: str | None = "n1", replans: int = 0
) -> ReplicaView:
    return replica_record(
        ReplicaRow(
            replica_id=rid,
            deployment="m",
            idx=0,
            state=state,
            engine="vllm",
            job_id=job,
            placed_node=placed,
            replans=replans,
            created_at=NOW,
            updated_at=NOW,
        )
    )


def job(jid: str, reason: str | None, state: str = "PENDING") -> JobInfo:
    return JobInfo(job_id=jid, raw_job_id=int(jid), name="x", state=state, reason=reason)


def test_node_reasons() -> None:
    assert stuck_on_node("Resources")
    assert stuck_on_node("ReqNodeNotAvail, May be reserved for other job")
    assert not stuck_on_node("Priority") and not stuck_on_node("Dependency")
    assert not stuck_on_node(None)


def test_due_only_after_the_wait_for_node_reasons_on_xhpc_choices() -> None:
    rows = [
        row("a", "1"),  # due
        row("b", "2"),  # pending for a reason moving would not fix
        row("c", "3", placed=None),  # pinned by the user
        row("d", "4", replans=3),  # moved enough
        row("e", "5", state="STARTING"),
        row("f", "6"),  # not waited long enough
        row("g", "7"),  # running
    ]
    jobs = {
        "1": job("1", "Resources"),
        "2": job("2", "Priority"),
        "3": job("3", "Resources"),
        "4": job("4", "Resources"),
        "5": job("5", "Resources"),
        "6": job("6", "Resources"),
        "7": job("7", None, state="RUNNING"),
    }
    old = NOW - timedelta(seconds=300)
    submitted = {j: old for j in jobs} | {"6": NOW - timedelta(seconds=5)}
    due = replan_due(rows, jobs, submitted, now=NOW, after_s=120, max_replans=3)
    assert [r.replica_id for r in due] == ["a"]
