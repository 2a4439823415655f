"""`xhpc usage` joins the keys' tokens with the GPU-hours Slurm accounting charged for the same
deployments' jobs: records matched to runs (hetjob components, requeues, reused ids), figures of
ended runs asked once, "n/a" (None) without accounting — never a made-up number."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_broker_service import RecordingSlurm, make
from xhpc.access import NO_KEY, Caller, JobCharge, JobUsage, KeyCreate, UsageCount, UsageLine
from xhpc.broker import api
from xhpc.broker.api import control_app
from xhpc.broker.watch.gpu_hours import (
    SACCT_LAG,
    gpu_hours_by_group,
    is_final,
    join_usage,
    records_by_run,
)
from xhpc.cli.admin.keys import usage
from xhpc.cli.context import Ctx
from xhpc.client.control import Client
from xhpc.config import load_config
from xhpc.errors import SlurmError
from xhpc.models import NodeInfo, ServeRequest, UnitState
from xhpc.records import UnitRecord
from xhpc.store.charges import job_charges
from xhpc.store.units import Units

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def rec(
    job_id: str, state: str = "COMPLETED", *, at: int = 5, s: int = 3600, **kw: Any
) -> JobUsage:
    """A record submitted ``at`` seconds after T0 that ran ``s`` seconds on one GPU of lab1."""
    values: dict[str, Any] = {"user": "root", "account": "lab1", "gpus": 1, **kw}
    return JobUsage(
        job_id=job_id, submitted_at=T0 + timedelta(seconds=at), elapsed_s=s, state=state, **values
    )


def run(name: str, job_id: str, *, at: int = 0, ended: int | None = None, **kw: Any) -> JobCharge:
    values: dict[str, Any] = {"model": "m", "owner": "alice", **kw}
    end = None if ended is None else T0 + timedelta(seconds=ended)
    return JobCharge(
        run=name, job_id=job_id, submitted_at=T0 + timedelta(seconds=at), ended_at=end, **values
    )


def line(
    key: str, user: str = "alice", account: str | None = "lab1", model: str = "m"
) -> UsageLine:
    return UsageLine(
        key_id=key,
        user=user,
        account=account,
        model=model,
        requests=1,
        prompt_tokens=10,
        completion_tokens=20,
    )


# -- records to runs ------------------------------------------------------------------------------
def test_a_hetjobs_components_and_a_requeued_jobs_runs_belong_to_their_run() -> None:
    unit, job = run("unit-u1", "30"), run("job-1", "31")
    records = [rec("30+1"), rec("31", "REQUEUED", s=60), rec("30+0"), rec("31", "RUNNING", at=900)]
    found = records_by_run([unit, job], records)
    assert [r.job_id for r in found["unit-u1"]] == ["30+0", "30+1"]
    assert [r.state for r in found["job-1"]] == ["REQUEUED", "RUNNING"]


def test_a_reused_job_id_is_charged_to_the_run_it_belongs_to() -> None:
    """Slurm's ids restart when its controller is rebuilt: two runs of the store, and an older
    job of the accounting database, all had id 7."""
    old, new = run("job-1", "7", at=0), run("job-2", "7", at=10_000)
    records = [rec("7", at=-9_000), rec("7", at=30), rec("7", at=10_030)]
    found = records_by_run([old, new], records)
    assert [r.submitted_at - T0 for r in found["job-1"]] == [timedelta(seconds=30)]
    assert [r.submitted_at - T0 for r in found["job-2"]] == [timedelta(seconds=10_030)]
    assert records_by_run([new], records[:2]) == {"job-2": ()}  # older than the run: not its


def test_a_run_is_final_once_the_last_record_of_each_job_has_ended() -> None:
    charge, now = run("job-1", "8"), T0 + timedelta(days=1)
    assert is_final(charge, [rec("8", "REQUEUED"), rec("8", "CANCELLED", at=60)], now)
    assert not is_final(charge, [rec("8", "REQUEUED")], now)  # it runs again
    assert not is_final(charge, [rec("8", "CANCELLED"), rec("8", "PENDING", at=60)], now)
    assert not is_final(charge, [rec("8+0", "COMPLETED"), rec("8+1", "RUNNING")], now)
    assert not is_final(charge, [], now)  # not recorded yet
    gone = run("job-1", "8", ended=0)
    assert is_final(gone, [], T0 + SACCT_LAG + timedelta(seconds=1))  # never will be
    assert not is_final(gone, [], T0 + SACCT_LAG)


# -- groups and the join --------------------------------------------------------------------------
def test_gpu_hours_add_up_per_owner_account_and_model() -> None:
    a, b = run("job-1", "1"), run("job-2", "2", model="n", owner=None)
    runs = {
        "job-1": (rec("1", s=1800, gpus=2), rec("1", at=99, s=900, account="lab2", gpus=4)),
        "job-2": (rec("2", s=360),),
    }
    assert gpu_hours_by_group([a, b], runs) == {
        ("alice", "lab1", "m"): 1.0,
        ("alice", "lab2", "m"): 1.0,
        ("?", "lab1", "n"): 0.1,  # a deployment from before owners
    }
    untracked = {"job-1": (rec("1"), rec("1", at=99, gpus=None)), "job-2": ()}
    assert gpu_hours_by_group([a, b], untracked) == {("alice", "lab1", "m"): None}


def test_one_keys_line_carries_its_groups_gpu_hours() -> None:
    (joined,) = join_usage([line("k1")], {("alice", "lab1", "m"): 2.5})
    assert joined == line("k1").model_copy(update={"gpu_hours": 2.5})


def test_gpu_hours_no_single_key_carries_get_a_line_of_their_own() -> None:
    lines = [line("k2"), line("k1"), line("k3", user="bob"), line("k4", model="other")]
    hours = {("alice", "lab1", "m"): 3.0, ("carol", "lab2", "m"): 1.5}
    joined = join_usage(lines, hours)
    assert [(u.key_id, u.user, u.model, u.requests, u.gpu_hours) for u in joined] == [
        (NO_KEY, "alice", "m", 0, 3.0),  # two keys of alice used m: neither carries it
        ("k1", "alice", "m", 1, 0.0),
        ("k2", "alice", "m", 1, 0.0),
        ("k4", "alice", "other", 1, 0.0),  # served by nobody of alice's
        ("k3", "bob", "m", 1, 0.0),  # bob used alice's model: alice's hours
        (NO_KEY, "carol", "m", 0, 1.5),  # nobody's key used carol's deployment
    ]
    assert sum(u.gpu_hours or 0 for u in joined) == sum(v or 0 for v in hours.values())
    assert sum(u.prompt_tokens for u in joined) == sum(u.prompt_tokens for u in lines)


_groups = st.tuples(
    st.sampled_from(["alice", "bob"]), st.sampled_from(["lab1", None]), st.sampled_from(["m", "n"])
)
_figures = st.one_of(st.none(), st.floats(0, 100, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(
    keyed=st.lists(_groups, max_size=8),
    hours=st.dictionaries(_groups, _figures, max_size=6),
)
def test_each_groups_gpu_hours_are_carried_once_and_tokens_are_kept(
    keyed: list[tuple[str, str | None, str]], hours: dict[tuple[str, str | None, str], float | None]
) -> None:
    lines = [line(f"k{i}", *group) for i, group in enumerate(keyed)]
    joined = join_usage(lines, hours)
    assert sorted(u.key_id for u in joined if u.key_id != NO_KEY) == sorted(u.key_id for u in lines)
    assert sum(u.completion_tokens for u in joined) == sum(u.completion_tokens for u in lines)
    for group in set(keyed) | set(hours):
        mine = [u for u in joined if (u.user, u.account, u.model) == group]
        carrying = [u for u in mine if u.gpu_hours != 0.0]
        figure = hours.get(group, 0.0)
        if figure == 0.0:
            assert carrying == []
        else:  # one line says it (None: not known); the others say 0
            assert [u.gpu_hours for u in carrying] == [figure]
    assert [_order_of(u) for u in joined] == sorted(_order_of(u) for u in joined)


def _order_of(u: UsageLine) -> tuple[str, str, str, str]:
    return (u.user, u.account or "", u.model, u.key_id)


def test_without_accounting_every_line_says_not_known() -> None:
    joined = join_usage([line("k2"), line("k1")], None)
    assert [(u.key_id, u.gpu_hours) for u in joined] == [("k1", None), ("k2", None)]


# -- the desk, over a real store ------------------------------------------------------------------
class AccountingSlurm(RecordingSlurm):
    """The recording fake with accounting on: sacct answers ``records``, or fails."""

    def __init__(self, nodes: list[NodeInfo], store: Any, fail_on: int | None = None) -> None:
        super().__init__(nodes, store, fail_on)
        self.storage = "accounting_storage/slurmdbd"
        self.records: list[JobUsage] = []
        self.asked: list[list[str]] = []
        self.sacct_fails = False

    async def accounting_storage_type(self) -> str:
        return self.storage

    async def job_usage(self, job_ids: Sequence[str], user: str) -> list[JobUsage]:
        self.asked.append(sorted(job_ids))
        if self.sacct_fails:
            raise SlurmError("sacct failed", argv=["sacct"], returncode=1, stderr="no slurmdbd")
        return [r for r in self.records if r.leader in job_ids]


ALICE = Caller(user="alice", uid=1000)


async def served(
    tmp_path: Path, nodes: list[NodeInfo], model_dir: Path, storage: str = "slurmdbd"
) -> Any:
    """Alice serves two replicas (jobs 100, 101) and a PD unit's hetjob (200) ran for her; her
    key (lab1) used the model. ``storage``: the accounting plugin (read once, at the first
    serve)."""
    service, slurm = make(tmp_path, nodes, slurm_cls=AccountingSlurm)
    slurm.storage = f"accounting_storage/{storage}"
    await service.serve(ServeRequest(model=str(model_dir), replicas=2), caller=ALICE)
    unit = UnitRecord(
        unit_id="u1",
        deployment="m",
        index=0,
        spec="1P1D",
        job_id="200",
        state=UnitState.ENDED,
        created_at=T0,
        updated_at=T0,
    )
    Units(service.store).add([unit])
    view, _ = service.keys.create(KeyCreate(user="alice", account="lab1"))
    service.keys.add_usage({view.key_id: {"m": UsageCount(requests=2, prompt_tokens=5)}})
    return service, slurm, view.key_id


async def test_usage_joins_tokens_with_the_gpu_hours_of_ended_and_running_jobs(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm, key = await served(tmp_path, idle_nodes, model_dir)
    charges = job_charges(service.store)
    assert [(c.job_id, c.model, c.owner) for c in charges] == [
        ("100", "m", "alice"),
        ("101", "m", "alice"),
        ("200", "m", "alice"),
    ]
    now = int((datetime.now(UTC) - T0).total_seconds())
    slurm.records = [
        rec("100", at=now, s=1800, gpus=2),
        rec("101", "RUNNING", at=now, s=3600),
        rec("200+0", "CANCELLED", s=720, account="lab2"),
        rec("200+1", "CANCELLED", s=720, account="lab2"),
    ]
    lines = await service.usage_desk.lines()
    assert [(u.key_id, u.account, u.requests, u.gpu_hours) for u in lines] == [
        (key, "lab1", 2, 2.0),
        (NO_KEY, "lab2", 0, 0.4),
    ]
    assert slurm.asked == [["100", "101", "200"]]
    slurm.records[1] = rec("101", "COMPLETED", at=now, s=7200)
    lines = await service.usage_desk.lines()
    assert [u.gpu_hours for u in lines] == [3.0, 0.4]
    assert slurm.asked[1:] == [["101"]]  # the ended runs are not asked again
    await service.usage_desk.lines()
    assert len(slurm.asked) == 2  # nothing left to ask


async def test_gpu_hours_are_not_known_when_sacct_fails_or_accounting_is_off(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm, key = await served(tmp_path, idle_nodes, model_dir)
    slurm.sacct_fails = True
    (only,) = await service.usage_desk.lines()
    assert (only.key_id, only.requests, only.gpu_hours) == (key, 2, None)

    service, slurm, key = await served(tmp_path / "off", idle_nodes, model_dir, "none")
    (only,) = await service.usage_desk.lines()
    assert (only.key_id, only.gpu_hours) == (key, None)
    assert slurm.asked == []


async def test_members_see_only_their_own_gpu_hours(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, slurm, _ = await served(tmp_path, idle_nodes, model_dir)
    slurm.records = [rec("200+0", "CANCELLED", s=3600)]
    for who, users in ((Caller(user="bob", uid=1001), set()), (ALICE, {"alice"})):
        monkeypatch.setattr(api, "peer_caller", lambda *_, who=who: who)
        async with TestClient(TestServer(control_app(service))) as client:
            resp = await client.get("/v1/usage")
            assert resp.status == 200
            assert {u["user"] for u in await resp.json()} == users


# -- the CLI --------------------------------------------------------------------------------------
@dataclass
class FakeBroker:
    lines: list[UsageLine] = field(default_factory=list)

    def get(self, path: str) -> Any:
        assert path == "/v1/usage"
        return [json.loads(u.model_dump_json()) for u in self.lines]


@dataclass
class FakeCtx(Ctx):
    fake: FakeBroker = field(default_factory=FakeBroker)

    @property
    def broker(self) -> Any:
        return Client.over(self.fake)  # type: ignore[arg-type]


def test_the_table_has_a_gpu_hours_column_and_json_the_field(clean_env: Path) -> None:
    config, sources = load_config()
    lines = [line("k1").model_copy(update={"gpu_hours": 1.25}), line("k2", user="bob")]
    ctx = FakeCtx(config=config, sources=sources, fake=FakeBroker(lines))
    table = CliRunner().invoke(usage, [], obj=ctx)
    assert table.exit_code == 0, table.output
    assert "GPU-h" in table.output
    (k1,) = [ln for ln in table.output.splitlines() if " k1 " in ln]
    (k2,) = [ln for ln in table.output.splitlines() if " k2 " in ln]
    assert "1.250" in k1 and "n/a" in k2
    out = CliRunner().invoke(usage, ["--json"], obj=ctx)
    assert [u["gpu_hours"] for u in json.loads(out.output)] == [1.25, None]


def test_an_older_brokers_lines_read_as_not_known() -> None:
    old = {k: v for k, v in json.loads(line("k1").model_dump_json()).items() if k != "gpu_hours"}
    assert UsageLine.model_validate(old).gpu_hours is None


def test_a_batch_s_array_tasks_are_its_run_and_charged_to_its_owner() -> None:
    """A job-array batch is one run (the array's id); each task's record ("500_0", a requeued
    task's second run) is its, charged to the batch's owner (the key's user) and model."""
    batch = run("batch-batch_x", "500", owner="bob", model="tiny-llama")
    other = run("job-1", "5000")  # no prefix confusion with an array's id
    records = [rec("500_0", s=1800), rec("500_1", s=3600), rec("500_1", at=90, s=1800, gpus=2),
               rec("5000", s=3600)]  # fmt: skip
    found = records_by_run([batch, other], records)
    assert [r.job_id for r in found["batch-batch_x"]] == ["500_0", "500_1", "500_1"]
    assert [r.job_id for r in found["job-1"]] == ["5000"]
    hours = gpu_hours_by_group([batch, other], found)
    assert hours[("bob", "lab1", "tiny-llama")] == 2.5
