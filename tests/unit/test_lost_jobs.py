"""A replica a proxy cannot reach is moved to another node at once when its agent does not
answer either (its whole job is gone), and left alone when the agent greets (real SQLite, a
real liveness port on loopback, a recording Slurm stand-in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.unit.test_keeper import make, slurm, state
from xhpc.agent.liveness import LivenessPort
from xhpc.broker.desks.agents import Verdict
from xhpc.broker.service import BrokerService
from xhpc.broker.watch.reconcile import observe
from xhpc.clock import utcnow
from xhpc.models import AgentRegistration, JobInfo, NodeInfo, ReplicaState, ServeRequest


async def serving_on(
    service: BrokerService, model_dir: Path, agent_port: int, **req: object
) -> str:
    """One READY replica, its agent's liveness port at ``agent_port``; returns its node."""
    await service.serve(ServeRequest.model_validate({"model": str(model_dir), **req}))
    row = service.store.replica("m-0")
    node = str(row.placed_node)
    slurm(service).queue = [
        JobInfo(job_id="100", raw_job_id=100, name="x", state="RUNNING", batch_host=node)
    ]
    await service.reconcile_once()
    reg = AgentRegistration(
        replica_id="m-0",
        job_id="100",
        node=node,
        host="127.0.0.1",
        port=free_port(),
        served_model="m",
        agent_port=agent_port,
    )
    assert service.agents.register(reg) is Verdict.OK
    return node


async def test_a_replica_whose_agent_is_silent_moves_to_another_node_at_once(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    service.lost_jobs.timeout_s = 0.2
    node = await serving_on(service, model_dir, agent_port=free_port())
    service.lost_jobs.suspect(service.agents.unreachable(["m-0"]))
    await service.lost_jobs.wait()
    row = service.store.replica("m-0")
    assert slurm(service).cancelled == ["100"]
    assert row.job_id == "101" and row.state == "QUEUED"
    assert row.placed_node not in (None, node)
    assert row.host is None and row.port is None
    assert f"job 100 lost on {node}: its agent does not answer" in str(row.reason)
    assert row.replans == 0  # a lost job's move leaves the re-planner's budget alone
    # The old run's agent, should its node come back, is refused.
    with pytest.raises(PermissionError):
        service.agents.register(
            AgentRegistration(
                replica_id="m-0",
                job_id="100",
                node=node,
                host="127.0.0.1",
                port=1,
                served_model="m",
            )
        )


async def test_a_replica_whose_agent_greets_stays_until_it_registers_again(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    agent = LivenessPort()
    port = await agent.start("127.0.0.1")
    try:
        await serving_on(service, model_dir, agent_port=port)
        service.lost_jobs.suspect(service.agents.unreachable(["m-0"]))
        await service.lost_jobs.wait()
    finally:
        await agent.stop()
    assert slurm(service).cancelled == [] and slurm(service).submitted == ["100"]
    assert state(service, "m-0") == "LOST"


async def test_with_nowhere_else_to_go_the_replica_waits_for_slurm(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    service.lost_jobs.timeout_s = 0.2
    only = idle_nodes[0].name
    await serving_on(service, model_dir, agent_port=free_port(), nodelist=only)
    service.lost_jobs.suspect(service.agents.unreachable(["m-0"]))
    await service.lost_jobs.wait()
    assert slurm(service).cancelled == []
    row = service.store.replica("m-0")
    assert row.state == "LOST" and row.job_id == "100"


async def test_a_reconcile_decided_on_the_lost_job_does_not_touch_its_successor(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """The reconcile reads rows outside the lock: what it decided for the lost job (it ended,
    or Slurm requeued it) must not land on the job that replaced it."""
    service = make(tmp_path, idle_nodes)
    service.lost_jobs.timeout_s = 0.2
    await serving_on(service, model_dir, agent_port=free_port())
    (stale,) = [r for r in service.store.replicas() if r.replica_id == "m-0"]
    service.lost_jobs.suspect(service.agents.unreachable(["m-0"]))
    await service.lost_jobs.wait()
    cancelled = JobInfo(job_id="100", raw_job_id=100, name="x", state="CANCELLED")
    (act,) = observe([stale], {"100": cancelled}, stale_before=None, now=utcnow())
    assert act.target is ReplicaState.FAILED and act.job_id == "100"
    service._apply(act)
    row = service.store.replica("m-0")
    assert row.state == "QUEUED" and row.job_id == "101" and row.restarts == 0
