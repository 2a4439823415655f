"""The broker's service with real SQLite and a recording Slurm stand-in (component tests).

The real-cluster tests (tests/cluster) prove the Slurm side; these pin down the broker's own
guarantees quickly: CREATING before sbatch, no partial deployment, tokens, the agent protocol.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from xhpc.broker.api import control_app
from xhpc.broker.desks.agents import Verdict, hash_token
from xhpc.broker.service import BrokerService
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    JobInfo,
    NodeInfo,
    PartitionInfo,
    ReplicaState,
    ServeRequest,
    StartEstimate,
)
from xhpc.orphans import OrphanFixRequest, OrphanFixResult, OrphanPolicy, OrphanReport
from xhpc.settings import XhpcConfig
from xhpc.slurm.partitions import parse_partitions
from xhpc.store import ReplicaRow, Store

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"


class RecordingSlurm:
    def __init__(self, nodes: list[NodeInfo], store: Store, fail_on: int | None = None) -> None:
        self._nodes = nodes
        self.store = store
        self.fail_on = fail_on
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self.requeued: list[str] = []
        self.states_at_submit: list[str] = []
        self.queue: list[JobInfo] = []
        self.estimates: dict[str, datetime] = {}  # node -> sbatch --test-only's start
        self.asked: list[tuple[str | None, str, tuple[str, ...]]] = []

    async def nodes(self) -> list[NodeInfo]:
        return self._nodes

    async def estimate_start(
        self, options: Sequence[str], partition: str | None, node: str
    ) -> StartEstimate:
        self.asked.append((partition, node, tuple(options)))
        if node not in self.estimates:
            raise SlurmError("sbatch --test-only failed", argv=["sbatch"], returncode=1)
        return StartEstimate(start=self.estimates[node], partition="gpu", nodes=node)

    async def jobs(self, job_ids: Sequence[str] = ()) -> list[JobInfo]:
        return self.queue

    async def submit(self, script: Path) -> str:
        # a replica's job (not a batch's array, nor a weights cache job)
        if script.parent.parent.name != "batches" and script.parent.name != "cache":
            self.states_at_submit.append(self.store.replica(script.parent.name).state)
        if self.fail_on is not None and len(self.submitted) + 1 == self.fail_on:
            raise SlurmError("sbatch failed", argv=["sbatch"], returncode=1, stderr="boom")
        job_id = str(100 + len(self.submitted))
        self.submitted.append(job_id)
        return job_id

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None:
        self.cancelled.extend(job_ids)

    async def requeue(self, job_ids: Sequence[str]) -> None:
        self.requeued.extend(job_ids)

    async def partitions(self) -> list[PartitionInfo]:
        return parse_partitions((DATA / "scontrol-show-partition.txt").read_text())

    async def accounting_storage_type(self) -> str:
        return "accounting_storage/none"

    async def topology(self) -> dict[str, str]:
        return {}  # no topology.conf: placement ignores switches

    async def user_accounts(self, user: str) -> list[str]:
        return []


def make(
    tmp_path: Path,
    nodes: list[NodeInfo],
    fail_on: int | None = None,
    slurm_cls: type[RecordingSlurm] = RecordingSlurm,
) -> tuple[BrokerService, RecordingSlurm]:
    config = XhpcConfig(state_dir=tmp_path / "state", models_dir=tmp_path / "models")
    store = Store(tmp_path / "state" / "x.db")
    slurm = slurm_cls(nodes, store, fail_on)
    return BrokerService(config, store, slurm), slurm


async def test_creating_is_written_before_sbatch(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=2))
    assert slurm.states_at_submit == ["CREATING", "CREATING"]
    assert [r.state.value for r in dep.replicas] == ["QUEUED", "QUEUED"]
    assert [r.job_id for r in dep.replicas] == ["100", "101"]


async def test_failed_sbatch_leaves_no_partial_deployment(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, fail_on=2)
    with pytest.raises(SlurmError):
        await service.serve(ServeRequest(model=str(model_dir), replicas=3))
    assert slurm.submitted == ["100"]
    assert slurm.cancelled == ["100"]
    rows = service.store.replicas(deployment="m")
    assert [r.state for r in rows] == ["FAILED", "FAILED", "FAILED"]
    assert service.store.get_deployment("m").stopped_at is not None


async def test_token_is_private_and_only_its_hash_is_stored(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    row = service.store.replica("m-0")
    rdir = Path(str(row.replica_dir))
    token = (rdir / "token").read_text()
    assert (rdir / "token").stat().st_mode & 0o777 == 0o600
    assert row.token_hash == hash_token(token) and token not in str(row.model_dump())
    assert token not in (rdir / "job.sbatch").read_text()
    assert token not in (rdir / "spec.json").read_text()
    service.agents.authenticate("m-0", token)
    for bad in ("", "x", token + "x"):
        with pytest.raises(PermissionError):
            service.agents.authenticate("m-0", bad)
    with pytest.raises(PermissionError):
        service.agents.authenticate("no-such-replica", token)


async def test_agent_protocol_moves_states_and_routes(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    assert service.routes().models == ("m",) and service.routes().routes == ()
    assert service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="starting"))
    assert service.store.replica("m-0").state == "STARTING"
    reg = AgentRegistration(
        replica_id="m-0",
        job_id="100",
        node="n1",
        host="10.0.0.1",
        port=9000,
        gpus=(2,),
        served_model="m",
    )
    service.agents.register(reg)
    (route,) = service.routes().routes
    assert route.url == "http://10.0.0.1:9000" and route.served_model == "m"
    with pytest.raises(PermissionError):
        service.agents.register(reg.model_copy(update={"job_id": "999"}))
    # A broker that lost the replica asks the agent to register again (the agent replays).
    service.store.transition("m-0", ReplicaState.LOST, "broker restarted")
    rep = AgentReport(replica_id="m-0", job_id="100", phase="ready")
    assert service.agents.report(rep) is Verdict.REGISTER
    service.agents.register(reg)
    assert service.store.replica("m-0").state == "READY"
    # SIGTERM reached the job (a requeue, preemption, or its end): out of the routing table at
    # once; what Slurm does with the job next decides the replica's state.
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="stopping"))
    assert service.store.replica("m-0").state == "READY"
    # The deployment still exists (its owner did not stop it): the proxy answers 503, not 404.
    assert service.routes().routes == () and service.routes().models == ("m",)
    # The time limit's warning (USR1) to the only replica: it serves to the end (no 503s).
    service.agents.register(reg)
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="draining"))
    row = service.store.replica("m-0")
    assert row.state == "READY" and "serving to the end" in str(row.reason)


async def test_reconcile_and_stop(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    slurm.queue = [
        JobInfo(job_id="100", raw_job_id=100, name="xhpc-m-0", state="PENDING", reason="Priority")
    ]
    assert await service.reconcile_once() == 1
    assert service.store.replica("m-0").reason == "Priority"
    slurm.queue = [
        JobInfo(
            job_id="100",
            raw_job_id=100,
            name="xhpc-m-0",
            state="RUNNING",
            batch_host="n2",
            gres_detail=("gpu:1(IDX:3)",),
            gpus_idx=(3,),
        )
    ]
    await service.reconcile_once()
    row = service.store.replica("m-0")
    assert (row.state, row.node, row.gpus) == ("STARTING", "n2", (3,))
    views = await service.stop("m")
    assert [v.state.value for v in views] == ["DRAINING"] and slurm.cancelled == ["100"]
    slurm.queue = [JobInfo(job_id="100", raw_job_id=100, name="xhpc-m-0", state="CANCELLED")]
    await service.reconcile_once()
    assert service.store.replica("m-0").state == "STOPPED"
    assert service.store.get_deployment("m").stopped_at is not None
    assert json.loads(service.routes().model_dump_json())["routes"] == []


# -- orphans ----------------------------------------------------------------------------------
# add to the imports: import os, pwd; from datetime import timedelta;
# from aiohttp.test_utils import TestClient, TestServer; from xhpc.broker.api import control_app;
# from xhpc.orphans import OrphanFixRequest, OrphanFixResult, OrphanPolicy, OrphanReport;
# from xhpc.clock import utcnow; from xhpc.store import ReplicaRow


ORPHAN_USER = pwd.getpwuid(os.getuid()).pw_name  # the user the broker judges jobs for


def _tagged(job_id: str, replica_id: str, dep: str = "m", state: str = "RUNNING") -> JobInfo:
    return JobInfo(
        job_id=job_id,
        raw_job_id=int(job_id),
        name=f"xhpc-{replica_id}",
        state=state,
        user=ORPHAN_USER,
        comment=f"xhpc:{dep}:{replica_id}",
    )


async def test_report_fix_and_adopt_through_the_api(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=2))
    r0, r1 = (r.replica_id for r in dep.replicas)
    with service.store.session() as s:  # both rows changed a minute ago: past the grace
        for rid in (r0, r1):
            row = s.get(ReplicaRow, rid)
            assert row is not None
            row.updated_at = utcnow() - timedelta(minutes=1)
            s.add(row)
    slurm.queue = [_tagged("100", r0), _tagged("555", "ghost-0", "ghost")]  # job 101 has vanished
    await service.poller.view(max_age_s=0.0)  # GET reads the shared view; --fix polls afresh

    async with TestClient(TestServer(control_app(service))) as client:
        resp = await client.get("/v1/orphans")
        assert resp.status == 200
        report = OrphanReport.model_validate_json(await resp.text())
        assert [j.job_id for j in report.jobs] == ["555"]
        assert [(r.replica_id, r.job_id) for r in report.replicas] == [(r1, "101")]

        body = OrphanFixRequest(policy=OrphanPolicy(job_without_replica="cancel"))
        resp = await client.post("/v1/orphans/fix", data=body.model_dump_json())
        fixed = OrphanFixResult.model_validate_json(await resp.text())
        assert slurm.cancelled == ["555"] and fixed.unresolved == 0
        assert service.store.replica(r1).state == "LOST"

        # The lost replica's job turns up under another id: adopt points the row at it.
        slurm.queue = [_tagged("100", r0), _tagged("777", r1)]
        body = OrphanFixRequest(policy=OrphanPolicy(job_without_replica="adopt"))
        resp = await client.post("/v1/orphans/fix", data=body.model_dump_json())
        fixed = OrphanFixResult.model_validate_json(await resp.text())
        assert [a.action.action.value for a in fixed.actions] == ["adopt"]
        assert all(a.applied for a in fixed.actions)
        assert service.store.replica(r1).job_id == "777"

        resp = await client.post("/v1/orphans/fix", data="")  # no body: the broker's policy
        assert resp.status == 200
        resp = await client.post("/v1/orphans/fix", data='{"policy": {"gpu_process": "kill"}}')
        assert resp.status == 400


async def test_an_unexpected_error_is_a_json_500(
    tmp_path: Path, idle_nodes: list[NodeInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = make(tmp_path, idle_nodes)

    def broken() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "routes", broken)
    async with TestClient(TestServer(control_app(service))) as client:
        resp = await client.get("/v1/routes")
        assert resp.status == 500
        body = await resp.json()
    assert body["error"]["code"] == "internal_error" and "boom" not in body["error"]["message"]


async def test_replicas_that_fit_nowhere_now_wait_in_slurms_queue(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=4, gpus=4))
    assert len(slurm.submitted) == 4 and [r.state.value for r in dep.replicas] == ["QUEUED"] * 4
    reserved = {r.replica_id: r.node for r in service.store.open_reservations()}
    assert sorted(reserved.values()) == ["n1", "n2", "n3"]
    (waiting,) = [r for r in dep.replicas if r.replica_id not in reserved]
    script = (tmp_path / "state" / "replicas" / waiting.replica_id / "job.sbatch").read_text()
    assert "--nodelist" not in script and "#SBATCH --gres=gpu:4" in script
    assert service.store.replica(waiting.replica_id).placed_node is None
    assert {node for _, node, _ in slurm.asked} == {"n1", "n2", "n3"}  # no estimate: Slurm's


async def test_a_replica_that_fits_nowhere_queues_where_slurm_expects_it_to_start_first(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    soon = datetime(2026, 12, 1, 14, 3, 27, tzinfo=UTC)
    slurm.estimates = {"n1": soon + timedelta(hours=2), "n2": soon, "n3": soon + timedelta(hours=1)}
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=4, gpus=4))
    waiting = dep.replicas[-1]  # n1..n3 are taken by the first three
    script = (tmp_path / "state" / "replicas" / waiting.replica_id / "job.sbatch").read_text()
    assert "#SBATCH --nodelist=n2" in script
    assert service.store.replica(waiting.replica_id).placed_node == "n2"  # may be re-planned
    asked = {opts for _, _, opts in slurm.asked}
    assert len(asked) == 1 and "--gres=gpu:4" in next(iter(asked))  # the replica's own shape
    events = [e.message for e in service.store.events(waiting.replica_id)]
    assert any(
        "nothing idle; n2 in gpu expected to start first at 14:03:27 UTC" in m for m in events
    ), events


async def test_no_estimates_are_asked_when_the_site_turns_them_off(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    service.config.placement.estimate_candidates = 0
    slurm.estimates = {"n2": datetime(2026, 12, 1, tzinfo=UTC)}
    await service.serve(ServeRequest(model=str(model_dir), replicas=4, gpus=4))
    assert slurm.asked == []


async def test_the_orphan_policy_comes_from_the_config(
    tmp_path: Path, idle_nodes: list[NodeInfo]
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    slurm.queue = [_tagged("900", "ghost-0", dep="ghost")]
    report = await service.fix_orphans(OrphanFixRequest())
    assert slurm.cancelled == [] and report.report.count == 1  # default: report only
    service.config.orphans = OrphanPolicy(job_without_replica="cancel")
    await service.fix_orphans(OrphanFixRequest())
    assert slurm.cancelled == ["900"]


async def test_replicas_carry_slurms_pending_reason_and_start_estimate_from_the_last_view(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), replicas=1))
    (r,) = dep.replicas
    start = utcnow() + timedelta(minutes=12)
    slurm.queue = [
        msgspec.structs.replace(
            _tagged(r.job_id or "", r.replica_id, dep=dep.name, state="PENDING"),
            reason="Resources",
            start_time=start,
        )
    ]
    await service.poller.view(0.0)  # the reconcile loop's poll; ps itself never polls
    polls = service.poller.polls
    (shown,) = service.replicas()
    assert shown.outlook is not None
    assert shown.outlook.pending_reason == "Resources" and shown.outlook.start_estimate == start
    (again,) = service.deployment(dep.name).replicas
    assert again.outlook == shown.outlook  # serve's progress reads the same
    assert service.poller.polls == polls
