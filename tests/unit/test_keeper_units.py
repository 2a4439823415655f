"""PD units under the keeper (real SQLite, a recording Slurm stand-in): a unit is one member of
its deployment, replaced whole by the restart policy with the crash-loop cap, and handed over
before its time limit like any other job."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from tests.unit.test_keeper import make as make_keeper
from tests.unit.test_keeper import slurm
from tests.unit.test_pd_units import UnitSlurm
from xhpc.broker.desks.agents import Verdict
from xhpc.broker.service import BrokerService
from xhpc.clock import utcnow
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    EngineKind,
    JobInfo,
    NodeInfo,
    RestartPolicy,
    ServeRequest,
)


def make(tmp_path: Path, nodes: list[NodeInfo], **lifecycle: float) -> BrokerService:
    return make_keeper(tmp_path, nodes, UnitSlurm, **lifecycle)


def hetjob(
    leader: str, start: datetime | None = None, limit_min: int | None = None
) -> list[JobInfo]:
    """A running unit's two components, as squeue lists them."""
    base = int(leader)
    return [
        JobInfo(
            job_id=str(base + off * 1000),
            raw_job_id=base + off * 1000,
            name="u",
            state="RUNNING",
            het_job_id=base,
            het_job_offset=off,
            start_time=start,
            time_limit_min=limit_min,
        )
        for off in (0, 1)
    ]


def register(service: BrokerService, unit: str, leader: str) -> None:
    for off, rid in enumerate((f"{unit}-p0", f"{unit}-d0")):
        reg = AgentRegistration(
            replica_id=rid,
            job_id=f"{leader}+{off}",
            node="n1",
            host="10.0.0.1",
            port=9000 + off,
            served_model="m",
            side_channel_port=5555,
        )
        assert service.agents.register(reg) is Verdict.OK


def unit_state(service: BrokerService, unit: str) -> str:
    return service.unit_desk.units.get(unit).state


async def serving(service: BrokerService, model_dir: Path, **req: object) -> None:
    await service.serve(
        ServeRequest(model=str(model_dir), pd="1P1D", engine=EngineKind.VLLM, **req)
    )
    slurm(service).queue = hetjob("100")
    await service.reconcile_once()
    register(service, "m-u0", "100")
    await service.reconcile_once()
    assert unit_state(service, "m-u0") == "READY"


def fail(service: BrokerService, unit: str, leader: str, detail: str = "boom") -> None:
    service.agents.report(
        AgentReport(replica_id=f"{unit}-d0", job_id=f"{leader}+1", phase="failed", detail=detail)
    )


async def test_a_unit_that_crash_loops_fails_the_deployment_after_three_starts(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir)
    fail(service, "m-u0", "100")
    # Each replacement unit fails to start: the third failed start fails the deployment,
    # instead of a new hetjob every pass.
    for attempt in range(1, 3):
        slurm(service).queue = []
        await service.reconcile_once()  # the degraded unit ends; the keeper replaces it
        leader = str(100 + attempt)
        assert slurm(service).submitted[-1] == leader
        assert service.unit_desk.units.get(f"m-u{attempt}").job_id == leader
        fail(service, f"m-u{attempt}", leader, f"engine exited; engine log: boom {attempt}")
    await service.reconcile_once()
    await service.reconcile_once()
    dep = service.deployment("m")
    assert dep.failed_reason is not None and "3 failed starts" in dep.failed_reason
    assert "boom 2" in dep.failed_reason
    assert len(slurm(service).submitted) == 3
    await service.reconcile_once()
    assert len(slurm(service).submitted) == 3


async def test_restart_never_leaves_an_ended_unit_ended(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await serving(service, model_dir, restart=RestartPolicy.NEVER)
    fail(service, "m-u0", "100")
    slurm(service).queue = []
    await service.reconcile_once()
    await service.reconcile_once()
    assert slurm(service).submitted == ["100"]
    assert slurm(service).cancelled == ["100"]  # the degraded unit's hetjob, whole


async def test_a_unit_is_handed_over_before_its_time_limit(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, handover_floor_s=300)
    await serving(service, model_dir)
    start = utcnow() - timedelta(minutes=8)
    slurm(service).queue = hetjob("100", start, 10)
    await service.reconcile_once()  # 2 minutes left < 300 s lead: a successor unit
    assert slurm(service).submitted == ["100", "101"]
    successor = service.unit_desk.units.instances("m-u1")
    assert {r.successor_of for r in successor} == {"m-u0"}
    await service.reconcile_once()
    assert slurm(service).submitted == ["100", "101"]  # one successor, not one per pass
    reasons = {r.reason for r in service.unit_desk.units.instances("m-u0")}
    assert all("handover: successor m-u1" in str(r) for r in reasons), reasons
    # The time-limit warning reaches the predecessor alone: it keeps serving (a unit is one job).
    report = AgentReport(replica_id="m-u0-p0", job_id="100+0", phase="draining")
    assert service.agents.report(report) is Verdict.OK
    assert service.store.replica("m-u0-p0").state == "READY"
    slurm(service).queue = [*hetjob("100", start, 10), *hetjob("101")]
    await service.reconcile_once()
    register(service, "m-u1", "101")
    await service.reconcile_once()  # the successor is READY: the predecessor is retired whole
    await service.reconcile_once()
    assert unit_state(service, "m-u1") == "READY"
    assert {r.state for r in service.unit_desk.units.instances("m-u0")} == {"DRAINING"}
    assert unit_state(service, "m-u0") == "STOPPING"
    assert {r.unit for r in service.routes().routes} == {"m-u1"}
    # Drained (no proxy reports any route or request to it): the whole hetjob is cancelled.
    for task in list(service._draining.values()):
        await task
    assert set(slurm(service).cancelled) == {"100"}  # the predecessor's hetjob, whole


async def test_a_deployment_waiting_out_a_units_backoff_stays_live(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, backoff_s=3600)
    await serving(service, model_dir)
    fail(service, "m-u0", "100")
    slurm(service).queue = hetjob("100")
    await service.reconcile_once()  # degraded: its hetjob is cancelled
    slurm(service).queue = []
    await service.reconcile_once()  # ... and gone: every instance has ended
    assert {r.state for r in service.unit_desk.units.instances("m-u0")} == {"FAILED", "STOPPED"}
    dep = service.deployment("m")
    assert not dep.stopped  # the replacement waits out its backoff; the model is not gone
    assert slurm(service).submitted == ["100"]
