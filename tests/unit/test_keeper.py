"""The keeper through the broker's service (real SQLite, a recording Slurm stand-in): replicas
are replaced, handed over before their time limit, requeued jobs leave the routing table, old
runs are refused, stop means stop, and a crash loop fails the deployment."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from tests.unit.test_broker_service import RecordingSlurm
from xhpc.broker.desks.agents import Verdict
from xhpc.broker.service import BrokerService
from xhpc.changes import ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import ValidationError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    JobInfo,
    NodeInfo,
    RestartPolicy,
    ServeRequest,
)
from xhpc.settings import LifecycleConfig, XhpcConfig
from xhpc.store import Store


def make(
    tmp_path: Path,
    nodes: list[NodeInfo],
    slurm_cls: type[RecordingSlurm] = RecordingSlurm,
    **lifecycle: float,
) -> BrokerService:
    """A service whose keeper acts at once (no backoff, no restart grace) unless told."""
    cfg = LifecycleConfig.model_validate({"backoff_s": 0, "restart_grace_s": 0, **lifecycle})
    config = XhpcConfig(state_dir=tmp_path / "state", models_dir=tmp_path / "models", lifecycle=cfg)
    store = Store(tmp_path / "state" / "x.db")
    return BrokerService(config, store, slurm_cls(nodes, store))


def slurm(service: BrokerService) -> RecordingSlurm:
    assert isinstance(service.slurm, RecordingSlurm)
    return service.slurm


def running(job_id: str, node: str = "n1", **kw: object) -> JobInfo:
    return JobInfo(
        job_id=job_id, raw_job_id=int(job_id), name="x", state="RUNNING", batch_host=node, **kw
    )


def register(service: BrokerService, rid: str, job_id: str, restarts: int = 0) -> Verdict:
    reg = AgentRegistration(
        replica_id=rid,
        job_id=job_id,
        node="n1",
        host="10.77.0.11",
        port=9000,
        served_model="m",
        restarts=restarts,
    )
    return service.agents.register(reg)


def state(service: BrokerService, rid: str) -> str:
    return service.store.replica(rid).state


async def serving(service: BrokerService, model_dir: Path, replicas: int = 1) -> None:
    await service.serve(ServeRequest(model=str(model_dir), replicas=replicas))
    slurm(service).queue = [running(str(100 + i)) for i in range(replicas)]
    await service.reconcile_once()
    for i in range(replicas):
        assert register(service, f"m-{i}", str(100 + i)) is Verdict.OK


async def test_an_engine_that_dies_is_replaced_and_the_model_never_404s(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="failed"))
    assert state(service, "m-0") == "FAILED"
    # Between the failure and the replacement the model still exists: 503, not 404.
    assert service.routes().models == ("m",) and service.routes().routes == ()
    slurm(service).queue = []
    await service.reconcile_once()
    assert slurm(service).submitted == ["100", "101"]
    assert state(service, "m-1") == "QUEUED"
    assert service.store.get_deployment("m").stopped_at is None


async def test_a_requeued_job_leaves_routing_and_only_its_next_run_may_register(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    assert len(service.routes().routes) == 1
    slurm(service).queue = [
        JobInfo(job_id="100", raw_job_id=100, name="x", state="PENDING", reason="BeginTime")
    ]
    await service.reconcile_once()
    assert state(service, "m-0") == "QUEUED" and service.routes().routes == ()
    # The old run's agent (SLURM_RESTART_COUNT=0) is told to stop; the new one (1) registers.
    hb = AgentReport(replica_id="m-0", job_id="100", phase="ready", restarts=0)
    assert service.agents.report(hb) is Verdict.GONE
    assert register(service, "m-0", "100", restarts=0) is Verdict.GONE
    assert slurm(service).submitted == ["100"]  # nothing replaced: the same job runs again
    slurm(service).queue = [running("100", node="n2", restart_count=1)]
    await service.reconcile_once()
    assert register(service, "m-0", "100", restarts=1) is Verdict.OK
    (route,) = service.routes().routes
    assert route.replica_id == "m-0"


async def test_an_ended_replica_refuses_its_agent(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    await service.stop("m")
    slurm(service).queue = []
    await service.reconcile_once()
    assert state(service, "m-0") == "STOPPED"
    hb = AgentReport(replica_id="m-0", job_id="100", phase="ready")
    assert service.agents.report(hb) is Verdict.GONE
    # Stopped by its owner: nothing replaces it and the model is gone (404).
    await service.reconcile_once()
    assert slurm(service).submitted == ["100"] and service.routes().models == ()


async def test_walltime_handover_submits_a_successor_then_drains_the_predecessor(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, handover_floor_s=300)
    await serving(service, model_dir)
    start = utcnow() - timedelta(minutes=8)
    slurm(service).queue = [running("100", start_time=start, time_limit_min=10)]
    await service.reconcile_once()  # 2 minutes left < 300 s lead: a successor
    assert slurm(service).submitted == ["100", "101"]
    assert service.store.replica("m-1").successor_of == "m-0"
    await service.reconcile_once()
    assert slurm(service).submitted == ["100", "101"]  # one successor, not one per pass
    assert "handover: successor m-1" in str(service.store.replica("m-0").reason)
    slurm(service).queue = [running("100", start_time=start, time_limit_min=10), running("101")]
    await service.reconcile_once()
    assert register(service, "m-1", "101") is Verdict.OK
    await service.reconcile_once()
    assert state(service, "m-0") == "DRAINING" and state(service, "m-1") == "READY"
    assert [r.replica_id for r in service.routes().routes] == ["m-1"]


async def test_a_replica_that_lost_a_rank_is_replaced_away_from_that_rank_s_node(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """A replica across nodes fails naming the node of its silent rank: that node is the
    failed replica's, and the keeper's cooldown keeps the replacement off it."""
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    lost = AgentReport(replica_id="m-0", job_id="100", phase="failed", node="n2",
                       detail="rank 1 of 2 on n2 silent for over 3s (node lost?)")  # fmt: skip
    service.agents.report(lost)
    row = service.store.replica("m-0")
    assert (row.state, row.node) == ("FAILED", "n2")
    slurm(service).queue = []
    await service.reconcile_once()
    placed = service.store.replica("m-1").placed_node
    assert placed is not None and placed != "n2"


async def test_a_crash_loop_fails_the_deployment_after_three_starts(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="failed"))
    # m-0 served for seconds only: its end is the first failed start of three.
    for attempt in range(1, 3):
        slurm(service).queue = []
        await service.reconcile_once()  # a replacement
        rid, job = f"m-{attempt}", str(100 + attempt)
        assert service.store.replica(rid).job_id == job
        detail = f"engine exited with code 1; engine log: boom {attempt}"
        service.agents.report(
            AgentReport(replica_id=rid, job_id=job, phase="failed", detail=detail)
        )
    await service.reconcile_once()
    dep = service.deployment("m")
    assert dep.failed_reason is not None and "3 failed starts" in dep.failed_reason
    assert "boom 2" in dep.failed_reason  # the engine log's last lines, in `xhpc ps`
    assert dep.stopped and len(slurm(service).submitted) == 3
    await service.reconcile_once()
    assert len(slurm(service).submitted) == 3


async def test_a_deployment_served_again_starts_a_new_history(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, crash_loop_starts=2)
    await serving(service, model_dir)
    service.agents.report(AgentReport(replica_id="m-0", job_id="100", phase="failed"))
    slurm(service).queue = []
    await service.reconcile_once()  # m-1 replaces it, and fails to start: a crash loop
    service.agents.report(AgentReport(replica_id="m-1", job_id="101", phase="failed"))
    await service.reconcile_once()
    assert service.deployment("m").failed_reason is not None
    # Served again: the old failures neither fail it at once nor make it "ever ready".
    await service.serve(ServeRequest(model=str(model_dir)))
    service.agents.report(AgentReport(replica_id="m-2", job_id="102", phase="failed"))
    await service.reconcile_once()
    dep = service.deployment("m")
    assert dep.stopped and dep.failed_reason is None  # a first start that failed: not retried
    assert len(slurm(service).submitted) == 3


async def test_on_failure_ends_a_deployment_whose_last_replica_stopped_cleanly(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir), restart=RestartPolicy.ON_FAILURE))
    slurm(service).queue = [running("100")]
    await service.reconcile_once()
    assert register(service, "m-0", "100") is Verdict.OK
    # Its job reaches its time limit: a planned end, not a failure.
    slurm(service).queue = [msgspec.structs.replace(running("100"), state="TIMEOUT")]
    await service.reconcile_once()
    assert service.store.replica("m-0").state == "STOPPED"
    assert service.deployment("m").stopped
    await service.reconcile_once()
    assert slurm(service).submitted == ["100"]


async def test_a_new_job_for_a_replica_resets_the_runs_it_expects(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    service.store.update_replica("m-0", ReplicaChange(restarts=2))
    service.store.update_replica(
        "m-0", ReplicaChange(job_id="555")
    )  # re-planned or adopted: a new job
    assert service.store.replica("m-0").restarts == 0
    assert register(service, "m-0", "555", restarts=0) is Verdict.OK


async def test_for_zero_is_refused_before_anything_is_submitted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    with pytest.raises(ValidationError, match="positive duration"):
        await service.serve(ServeRequest(model=str(model_dir), run_for="0"))
    assert slurm(service).submitted == []


async def test_for_unlimited_is_until_stopped(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir), run_for="UNLIMITED"))
    assert service.store.get_deployment("m").until_at is None


async def test_a_replica_a_proxy_cannot_reach_leaves_routing_until_its_agent_answers(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir, replicas=2)
    service.agents.unreachable(["m-0", "nobody"])
    assert state(service, "m-0") == "LOST" and state(service, "m-1") == "READY"
    assert [r.replica_id for r in service.routes().routes] == ["m-1"]
    # Alive after all (a refused connect of a moment): its next heartbeat registers it again.
    ready = AgentReport(replica_id="m-0", job_id="100", phase="ready")
    assert service.agents.report(ready) is Verdict.REGISTER
    assert register(service, "m-0", "100") is Verdict.OK
    assert state(service, "m-0") == "READY"
    assert sorted(r.replica_id for r in service.routes().routes) == ["m-0", "m-1"]
