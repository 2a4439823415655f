"""Orphans: find_orphans (pure), plan_actions (policy), `xhpc doctor` with an injected broker."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from xhpc.broker.watch.orphans import find_orphans, parse_tag
from xhpc.cli.context import Ctx
from xhpc.cli.observe.doctor import doctor
from xhpc.client.control import Client
from xhpc.config import load_config
from xhpc.models import GpuProbe, GpuProcess, JobInfo, ProbeReport, ReplicaState, ReplicaView
from xhpc.orphans import (
    ActionKind,
    AppliedAction,
    JobOrphan,
    OrphanFixRequest,
    OrphanFixResult,
    OrphanKind,
    OrphanPolicy,
    OrphanReport,
    plan_actions,
)
from xhpc.store import replica_record
from xhpc.store.tables import ReplicaRow

S = ReplicaState
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
OLD = NOW - timedelta(minutes=5)
TTL_S = 30.0


def job(
    job_id: str,
    state: str = "RUNNING",
    comment: str | None = None,
    user: str | None = "alice",
    raw: int | None = None,
) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        raw_job_id=raw if raw is not None else int(job_id.split("_")[0]),
        name=f"job-{job_id}",
        state=state,
        user=user,
        comment=comment,
        nodes="n1",
    )


def tagged(job_id: str, replica_id: str, state: str = "RUNNING", dep: str = "m") -> JobInfo:
    return job(job_id, state, comment=f"xhpc:{dep}:{replica_id}")


def row(
    replica_id: str,
    state: S = S.READY,
    job_id: str | None = None,
    updated: datetime = OLD,
    deployment: str = "m",
) -> ReplicaView:
    """The replica as the store shows it (its row through ``replica_record``)."""
    return replica_record(
        ReplicaRow(
            replica_id=replica_id,
            deployment=deployment,
            idx=int(replica_id.rsplit("-", 1)[-1]),
            state=state.value,
            engine="vllm",
            job_id=job_id,
            created_at=updated,
            updated_at=updated,
        )
    )


def probe(node: str, *procs: GpuProcess, taken_at: datetime = NOW, index: int = 0) -> ProbeReport:
    gpu = GpuProbe(index=index, mem_used_mb=1000, mem_total_mb=8000, processes=procs)
    return ProbeReport(node=node, taken_at=taken_at, backend="fake", gpus=(gpu,))


def find(
    jobs: list[JobInfo] = [],  # noqa: B006 - never mutated
    rows: list[ReplicaView] = [],  # noqa: B006
    probes: list[ProbeReport] = [],  # noqa: B006
    user: str | None = "alice",
) -> OrphanReport:
    return find_orphans(
        jobs, rows, {p.node: p for p in probes}, now=NOW, probe_ttl_s=TTL_S, user=user
    )


# -- tags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("comment", "expected"),
    [
        ("xhpc:m:m-0", ("m", "m-0")),
        ("xhpc:llama.3b:llama.3b-12", ("llama.3b", "llama.3b-12")),
        (None, None),
        ("", None),
        ("xhpcx:m:m-0", None),
        ("XHPC:m:m-0", None),
        ("other:m:m-0", None),
        ("xhpc:", None),
        ("xhpc:m", None),
        ("xhpc:b1:m:m-0", ("m", "m-0")),  # with a broker id (any, when none is given)
        ("xhpc:b1:m:m-0:extra", None),
        ("xhpc:m:", None),
        ("xhpc:m:m 0; rm -rf /", None),
        ("xhpc:../etc:m-0", None),
    ],
)
def test_parse_tag(comment: str | None, expected: tuple[str, str] | None) -> None:
    assert parse_tag(comment) == expected


def test_parse_tag_keeps_to_its_broker() -> None:
    assert parse_tag("xhpc:b1:m:m-0", "b1") == ("m", "m-0")
    assert parse_tag("xhpc:b2:m:m-0", "b1") is None  # another broker's job: not ours to judge
    assert parse_tag("xhpc:m:m-0", "b1") == ("m", "m-0")  # the older, broker-less tag


# -- gpu_process ----------------------------------------------------------------------------------


def test_gpu_process_without_a_job_is_an_orphan() -> None:
    report = find(probes=[probe("n1", GpuProcess(pid=42, mem_used_mb=512))])
    (orphan,) = report.gpu_processes
    assert (orphan.node, orphan.gpu, orphan.pid, orphan.mem_used_mb) == ("n1", 0, 42, 512)
    assert orphan.job_id is None and orphan.reason == "no Slurm job"
    assert report.count == 1


def test_gpu_process_of_a_vanished_or_ended_job_is_an_orphan() -> None:
    report = find(
        jobs=[job("7", "COMPLETED"), job("8", "RUNNING"), job("9", "COMPLETING")],
        probes=[
            probe(
                "n1",
                GpuProcess(pid=1, job_id="6"),
                GpuProcess(pid=2, job_id="7"),
                GpuProcess(pid=3, job_id="8"),
                GpuProcess(pid=4, job_id="9"),
            )
        ],
    )
    assert [(o.pid, o.reason) for o in report.gpu_processes] == [
        (1, "job 6 is not in squeue"),
        (2, "job 7 has ended (COMPLETED)"),
    ]


def test_gpu_process_known_by_the_raw_id_of_an_array_task_is_not_an_orphan() -> None:
    report = find(
        jobs=[job("100_3", raw=104)], probes=[probe("n1", GpuProcess(pid=1, job_id="104"))]
    )
    assert report.gpu_processes == ()


def test_stale_probe_is_ignored_and_named() -> None:
    stale = probe("n2", GpuProcess(pid=9), taken_at=NOW - timedelta(seconds=TTL_S + 1))
    fresh = probe("n1", GpuProcess(pid=8), taken_at=NOW - timedelta(seconds=TTL_S))
    report = find(probes=[stale, fresh])
    assert [(o.node, o.pid) for o in report.gpu_processes] == [("n1", 8)]
    assert report.unprobed_nodes == ("n2",)


def test_gpu_process_holding_no_memory_is_not_an_orphan() -> None:
    report = find(probes=[probe("n1", GpuProcess(pid=1, mem_used_mb=0), GpuProcess(pid=2))])
    assert [o.pid for o in report.gpu_processes] == [2]  # unknown memory still counts


# -- job_without_replica --------------------------------------------------------------------------


def test_tagged_job_with_no_row_is_an_orphan() -> None:
    report = find(jobs=[tagged("5", "ghost-0", dep="ghost")])
    (orphan,) = report.jobs
    assert (orphan.job_id, orphan.deployment, orphan.replica_id) == ("5", "ghost", "ghost-0")
    assert orphan.row_state is None and orphan.reason == "no replica row"


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "SUSPENDED", "CONFIGURING"])
def test_only_active_jobs_count(state: str) -> None:
    assert len(find(jobs=[tagged("5", "m-0", state)]).jobs) == 1


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "COMPLETING"])
def test_ending_and_ended_jobs_do_not_count(state: str) -> None:
    assert find(jobs=[tagged("5", "m-0", state)]).jobs == ()


@pytest.mark.parametrize("comment", [None, "", "mine", "xhpc-m-0", "xhpc:broken", "slurm:m:m-0"])
def test_jobs_not_tagged_as_xhpcs_are_not_judged(comment: str | None) -> None:
    assert find(jobs=[job("5", comment=comment)]).jobs == ()


def test_other_users_jobs_are_not_judged() -> None:
    other = job("5", comment="xhpc:m:m-0", user="bob")
    unknown_user = job("6", comment="xhpc:m:m-1", user=None)
    report = find(jobs=[other, unknown_user])
    assert [o.job_id for o in report.jobs] == ["6"]
    assert [o.job_id for o in find(jobs=[other], user=None).jobs] == ["5"]


@pytest.mark.parametrize("state", [S.STOPPED, S.FAILED])
def test_job_of_a_terminal_row_is_an_orphan(state: S) -> None:
    (orphan,) = find(jobs=[tagged("5", "m-0")], rows=[row("m-0", state, "5")]).jobs
    assert orphan.row_state is state and orphan.reason == f"replica row is {state.value}"


def test_job_that_its_row_does_not_name_is_an_orphan() -> None:
    jobs = [tagged("5", "m-0"), tagged("6", "m-0")]
    (orphan,) = find(jobs=jobs, rows=[row("m-0", S.READY, "6")]).jobs
    assert orphan.job_id == "5" and orphan.row_job_id == "6" and orphan.row_job_active
    assert orphan.reason == "replica row names job 6"


def test_job_that_its_row_names_is_not_an_orphan() -> None:
    assert find(jobs=[tagged("5", "m-0")], rows=[row("m-0", S.STARTING, "5")]).jobs == ()


def test_launch_in_flight_is_not_an_orphan() -> None:
    # sbatch returned, the row is still CREATING without its job id: not an orphan.
    creating = row("m-0", S.CREATING, None, updated=NOW)
    assert find(jobs=[tagged("5", "m-0", "PENDING")], rows=[creating]).jobs == ()


def test_job_whose_row_belongs_to_another_deployment_is_an_orphan() -> None:
    (orphan,) = find(jobs=[tagged("5", "m-0", dep="x")], rows=[row("m-0", S.READY, "5")]).jobs
    assert orphan.reason == "replica row belongs to deployment m"


# -- replica_without_job --------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.QUEUED, S.STARTING, S.READY, S.DRAINING])
def test_row_whose_job_left_squeue_is_an_orphan(state: S) -> None:
    (orphan,) = find(rows=[row("m-0", state, "5")]).replicas
    assert (orphan.replica_id, orphan.state, orphan.job_id) == ("m-0", state, "5")
    assert orphan.reason == "job 5 is not in squeue" and orphan.idle_s == 300


def test_row_whose_job_ended_is_an_orphan() -> None:
    (orphan,) = find(jobs=[job("5", "TIMEOUT")], rows=[row("m-0", S.READY, "5")]).replicas
    assert orphan.job_state == "TIMEOUT" and orphan.reason == "job 5 has ended (TIMEOUT)"


def test_row_with_a_live_job_is_not_an_orphan() -> None:
    jobs = [job("5", "RUNNING"), job("6", "PENDING"), job("7", "COMPLETING")]
    rows = [row("m-0", S.READY, "5"), row("m-1", S.QUEUED, "6"), row("m-2", S.DRAINING, "7")]
    assert find(jobs=jobs, rows=rows).replicas == ()


def test_young_rows_are_not_judged() -> None:
    young = NOW - timedelta(seconds=29)
    rows = [row("m-0", S.CREATING, None, updated=young), row("m-1", S.QUEUED, "5", updated=young)]
    assert find(rows=rows).replicas == ()


def test_creating_row_past_the_grace_was_never_submitted() -> None:
    (orphan,) = find(rows=[row("m-0", S.CREATING, None)]).replicas
    assert orphan.reason == "never submitted"


@pytest.mark.parametrize("state", [S.STOPPED, S.FAILED, S.LOST])
def test_terminal_and_lost_rows_are_not_judged(state: S) -> None:
    assert find(rows=[row("m-0", state, "5")]).replicas == ()


def test_naive_timestamps_from_sqlite_are_utc() -> None:
    naive = (NOW - timedelta(seconds=60)).replace(tzinfo=None)
    (orphan,) = find(rows=[row("m-0", S.READY, "5", updated=naive)]).replicas
    assert orphan.idle_s == 60


def test_empty_inputs_report_nothing() -> None:
    report = find()
    assert report.count == 0 and report.taken_at == NOW and report.grace_s == 30


def test_report_round_trips_as_json() -> None:
    report = find(
        jobs=[tagged("5", "g-0", dep="g")],
        rows=[row("m-0", S.READY, "9")],
        probes=[probe("n1", GpuProcess(pid=1))],
    )
    assert report.count == 3
    assert OrphanReport.model_validate_json(report.model_dump_json()) == report


# -- plan_actions ---------------------------------------------------------------------------------


def _everything() -> OrphanReport:
    return find(
        jobs=[tagged("5", "ghost-0", dep="ghost"), tagged("6", "m-1"), tagged("7", "m-2")],
        rows=[
            row("m-0", S.READY, "9"),  # job gone: replica_without_job
            row("m-1", S.LOST, "8"),  # job 8 gone, job 6 tagged m-1: adoptable
            row("m-2", S.STOPPED, "7"),  # terminal: not adoptable
            row("m-3", S.DRAINING, "10"),
            row("m-4", S.CREATING, None),
        ],
        probes=[probe("n1", GpuProcess(pid=1))],
    )


def _by(actions: list[Any], kind: OrphanKind) -> list[tuple[Any, ...]]:
    return [(a.action, a.job_id or a.replica_id, a.target) for a in actions if a.kind is kind]


def test_default_policy_reports_jobs_and_marks_replicas() -> None:
    actions = plan_actions(_everything(), OrphanPolicy())
    assert len(actions) == _everything().count
    assert _by(actions, OrphanKind.GPU_PROCESS) == [(ActionKind.REPORT, None, None)]
    assert {a.action for a in actions if a.kind is OrphanKind.JOB_WITHOUT_REPLICA} == {
        ActionKind.REPORT
    }
    assert _by(actions, OrphanKind.REPLICA_WITHOUT_JOB) == [
        (ActionKind.MARK_LOST, "9", S.LOST),
        (ActionKind.MARK_LOST, "10", S.STOPPED),  # DRAINING whose job is gone: stopped
        (ActionKind.MARK_LOST, "m-4", S.FAILED),  # CREATING cannot become LOST
    ]


def test_cancel_policy_cancels_every_job_orphan() -> None:
    actions = plan_actions(_everything(), OrphanPolicy(job_without_replica="cancel"))
    assert _by(actions, OrphanKind.JOB_WITHOUT_REPLICA) == [
        (ActionKind.CANCEL, "5", None),
        (ActionKind.CANCEL, "6", None),
        (ActionKind.CANCEL, "7", None),
    ]
    assert all(a.action is ActionKind.REPORT for a in actions if a.kind is OrphanKind.GPU_PROCESS)


def test_adopt_only_where_a_live_row_can_take_the_job() -> None:
    actions = plan_actions(_everything(), OrphanPolicy(job_without_replica="adopt"))
    assert _by(actions, OrphanKind.JOB_WITHOUT_REPLICA) == [
        (ActionKind.REPORT, "5", None),  # no row
        (ActionKind.ADOPT, "6", None),
        (ActionKind.REPORT, "7", None),  # terminal row
    ]
    adopt = next(a for a in actions if a.action is ActionKind.ADOPT)
    assert adopt.replica_id == "m-1"


def test_adopt_never_steals_a_row_whose_own_job_is_alive() -> None:
    report = find(jobs=[tagged("5", "m-0"), tagged("6", "m-0")], rows=[row("m-0", S.READY, "6")])
    (act,) = plan_actions(report, OrphanPolicy(job_without_replica="adopt"))
    assert act.action is ActionKind.REPORT and act.reason.startswith("not adoptable")


def test_job_ids_narrow_cancel() -> None:
    actions = plan_actions(_everything(), OrphanPolicy(job_without_replica="cancel"), job_ids=["6"])
    assert [a.action for a in actions if a.kind is OrphanKind.JOB_WITHOUT_REPLICA] == [
        ActionKind.REPORT,
        ActionKind.CANCEL,
        ActionKind.REPORT,
    ]


def test_report_policy_for_replicas_changes_nothing() -> None:
    policy = OrphanPolicy(replica_without_job="report")
    assert {a.action for a in plan_actions(_everything(), policy)} == {ActionKind.REPORT}


def test_policy_rejects_unknown_values_and_keys() -> None:
    with pytest.raises(ValueError):
        OrphanPolicy(gpu_process="kill")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OrphanPolicy.model_validate({"job_without_replica": "cancel", "typo": 1})
    assert OrphanFixRequest.model_validate_json("{}") == OrphanFixRequest()


# -- xhpc doctor (click runner, injected broker) --------------------------------------------------


@dataclass
class FakeBroker:
    report: OrphanReport
    applied_ok: bool = True
    calls: list[tuple[str, str, Any]] = field(default_factory=list)

    def get(self, path: str) -> Any:
        self.calls.append(("GET", path, None))
        return json.loads(self.report.model_dump_json())

    def post(self, path: str, body: str) -> Any:
        req = OrphanFixRequest.model_validate_json(body)
        self.calls.append(("POST", path, req))
        planned = plan_actions(self.report, req.policy or OrphanPolicy(), job_ids=req.job_ids)
        applied = tuple(
            AppliedAction(
                action=a,
                applied=a.action is not ActionKind.REPORT and self.applied_ok,
                error=None if self.applied_ok else "boom",
            )
            for a in planned
        )
        return json.loads(OrphanFixResult(report=self.report, actions=applied).model_dump_json())


@dataclass
class FakeCtx(Ctx):
    fake: FakeBroker | None = None

    @property
    def broker(self) -> Any:
        return Client.over(self.fake)  # type: ignore[arg-type]


@pytest.fixture
def make_ctx(clean_env: Path) -> Any:
    config, sources = load_config()

    def make(report: OrphanReport, applied_ok: bool = True) -> FakeCtx:
        return FakeCtx(config=config, sources=sources, fake=FakeBroker(report, applied_ok))

    return make


def invoke(ctx: FakeCtx, *args: str) -> Result:
    return CliRunner().invoke(doctor, list(args), obj=ctx)


def _ghost() -> OrphanReport:
    return find(jobs=[tagged("5", "ghost-0", dep="ghost")])


def test_doctor_exits_0_when_clean(make_ctx: Any) -> None:
    ctx = make_ctx(find())
    result = invoke(ctx)
    assert result.exit_code == 0, result.output
    assert "no orphans" in result.output
    assert ctx.fake.calls == [("GET", "/v1/orphans", None)]
    result = invoke(ctx, "--orphans", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["count"] == 0


def test_doctor_json_lists_orphans_and_exits_1(make_ctx: Any) -> None:
    result = invoke(make_ctx(_ghost()), "--orphans", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["count"] == 1
    (orphan,) = data["jobs"]
    assert JobOrphan.model_validate(orphan).replica_id == "ghost-0"
    assert orphan["kind"] == "job_without_replica"


def test_doctor_table_previews_the_fix(make_ctx: Any) -> None:
    report = _everything()
    result = invoke(make_ctx(report), "--cancel-unknown-jobs")
    assert result.exit_code == 1
    for title in ("GPU processes", "xhpc jobs with no replica", "replicas with no job"):
        assert title in result.output
    assert "would cancel" in result.output and "would mark-lost -> LOST" in result.output


def test_doctor_fix_posts_the_policy_and_exits_0_when_all_resolved(make_ctx: Any) -> None:
    ctx = make_ctx(_ghost())
    result = invoke(ctx, "--fix", "--cancel-unknown-jobs", "--job", "5", "--json")
    assert result.exit_code == 0, result.output
    (_, path, req) = ctx.fake.calls[0]
    assert path == "/v1/orphans/fix"
    assert req.policy.job_without_replica == "cancel" and req.job_ids == ("5",)
    data = json.loads(result.output)
    assert data["unresolved"] == 0 and data["actions"][0]["action"]["action"] == "cancel"


def test_doctor_fix_exits_1_when_orphans_remain(make_ctx: Any) -> None:
    ctx = make_ctx(_ghost())
    result = invoke(ctx, "--fix")  # broker default: report unknown jobs
    assert result.exit_code == 1 and "report only" in result.output
    assert ctx.fake.calls[0][2].policy is None
    failed = invoke(make_ctx(_ghost(), applied_ok=False), "--fix", "--cancel-unknown-jobs")
    assert failed.exit_code == 1 and "failed: cancel" in failed.output


def test_doctor_rejects_two_job_policies(make_ctx: Any) -> None:
    result = invoke(make_ctx(find()), "--fix", "--cancel-unknown-jobs", "--adopt-jobs")
    assert result.exit_code == 2 and "not both" in result.output


def test_doctor_table_prints_hostile_strings_literally(make_ctx: Any) -> None:
    report = find(probes=[probe("n1", GpuProcess(pid=1, job_id="[bold]x[/bold]"))])
    result = invoke(make_ctx(report))
    assert result.exit_code == 1
    assert "[bold]x[/bold]" in result.output  # not taken for rich markup
