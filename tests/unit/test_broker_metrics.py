"""The broker's own metrics (``xhpc.broker.metrics``) move when their code paths run, on a
broker with real SQLite and the recording Slurm stand-in: queue waits when a job starts,
requeues, replacements, walltime handovers, lost jobs moved, autoscaling decisions, sbatch's
time at the Slurm client's chokepoint; ``GET /v1/metrics`` serves them as Prometheus text to
admins and the proxy's identity, and refuses anyone else."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.test_proxy_gateway import value
from tests.unit.test_autoscale_desk import Clock, _load
from tests.unit.test_keeper import make, register, running, serving, slurm
from tests.unit.test_lost_jobs import free_port, serving_on
from tests.unit.test_prometheus_text import parse_metrics
from xhpc.access import Caller
from xhpc.broker import api
from xhpc.broker.api import control_app
from xhpc.broker.desks import autoscale_desk
from xhpc.broker.metrics import BrokerMetrics, direction
from xhpc.broker.service import BrokerService
from xhpc.clock import utcnow
from xhpc.errors import SlurmError
from xhpc.models import AgentReport, JobInfo, NodeInfo, ScalingPolicy, ServeRequest
from xhpc.settings import SlurmConfig
from xhpc.slurm.client import CliSlurmClient

MEMBER = Caller(user="bob", uid=1001)
ADMIN = Caller(user="ann", uid=1002, admin=True)
PROXY = Caller(user="gw", uid=1003, proxy=True)


def exposed(service: BrokerService) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The broker's exposition, read by the strict reader."""
    return parse_metrics(service.metrics.render(service))


async def test_a_job_that_starts_is_a_queue_wait_and_one_taken_back_a_requeue(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    samples = exposed(service)
    assert value(samples, "xhpc_broker_replicas", deployment="m", state="QUEUED") == 1
    assert value(samples, "xhpc_broker_replicas", deployment="m", state="READY") == 0
    assert value(samples, "xhpc_broker_queue_wait_seconds_count", deployment="m") == 0
    slurm(service).queue = [running("100")]
    await service.reconcile_once()
    waits = service.metrics.queue_waits
    assert waits.count(("m",)) == 1 and 0 <= waits.values[("m",)][1][0] < 60
    assert register(service, "m-0", "100").value == "ok"
    slurm(service).queue = [
        JobInfo(job_id="100", raw_job_id=100, name="x", state="PENDING", reason="BeginTime")
    ]
    await service.reconcile_once()
    assert service.metrics.replacements.value(("m", "requeue")) == 1
    samples = exposed(service)
    assert value(samples, "xhpc_broker_queue_wait_seconds_count", deployment="m") == 1
    assert value(samples, "xhpc_broker_replacements_total", deployment="m", reason="requeue") == 1


async def test_replacements_and_handovers_are_counted_where_the_keeper_acts(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, handover_floor_s=300)
    await serving(service, model_dir)
    start = utcnow() - timedelta(minutes=8)
    slurm(service).queue = [running("100", start_time=start, time_limit_min=10)]
    await service.reconcile_once()  # 2 minutes left: a successor
    handovers = service.metrics.handovers
    assert handovers.value(("m", "started")) == 1 and handovers.value(("m", "completed")) == 0
    slurm(service).queue = [running("100", start_time=start, time_limit_min=10), running("101")]
    await service.reconcile_once()
    register(service, "m-1", "101")
    await service.reconcile_once()
    assert handovers.value(("m", "completed")) == 1
    # The successor's engine dies: the keeper replaces it.
    service.agents.report(AgentReport(replica_id="m-1", job_id="101", phase="failed"))
    slurm(service).queue = []
    await service.reconcile_once()
    assert service.metrics.replacements.value(("m", "replace")) == 1
    samples = exposed(service)
    assert value(samples, "xhpc_broker_handovers_total", deployment="m", outcome="started") == 1
    assert value(samples, "xhpc_broker_replacements_total", deployment="m", reason="replace") == 1


async def test_a_refused_successor_is_a_refused_handover(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes, handover_floor_s=300)
    await serving(service, model_dir)
    slurm(service).fail_on = 2  # the successor's sbatch
    start = utcnow() - timedelta(minutes=8)
    slurm(service).queue = [running("100", start_time=start, time_limit_min=10)]
    await service.reconcile_once()
    assert service.metrics.handovers.value(("m", "refused")) == 1
    assert service.metrics.handovers.value(("m", "started")) == 0


async def test_a_lost_job_moved_to_another_node_is_counted(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = make(tmp_path, idle_nodes)
    service.lost_jobs.timeout_s = 0.2
    await serving_on(service, model_dir, agent_port=free_port())
    service.lost_jobs.suspect(service.agents.unreachable(["m-0"]))
    await service.lost_jobs.wait()
    assert service.store.replica("m-0").job_id == "101"
    assert service.metrics.replacements.value(("m", "lost")) == 1
    assert service.metrics.replacements.value(("m", "requeue")) == 0


async def test_autoscaling_decisions_are_counted_by_direction(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(autoscale_desk, "monotonic", clock)
    service = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=0, max_replicas=3, target_in_flight=2, idle_s=60)
    dep = await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy))
    (first,) = [r.replica_id for r in dep.replicas]
    _load(service, **{first: 5})
    await service.autoscaler.run()  # up to 3
    clock.now += 2
    await service.autoscaler.run()  # held at 3 (the maximum)
    scaling = service.metrics.scaling
    assert scaling.value(("m", "up", "demand")) == 1
    assert not [way for (_, way, _) in scaling.values if way == "hold"]  # changes only
    samples = exposed(service)
    labels = {"deployment": "m", "direction": "up", "why": "demand"}
    assert value(samples, "xhpc_broker_scaling_decisions_total", **labels) == 1
    assert [direction(c, w) for c, w in ((1, 1), (0, 2), (2, 0), (1, 3), (3, 2))] == [
        "hold", "wake", "sleep", "up", "down",
    ]  # fmt: skip
    await service.autoscaler.close()


def _fake_sbatch(tmp_path: Path, rc: int) -> Path:
    bin_dir = tmp_path / f"bin{rc}"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(f"#!/bin/sh\necho '4242'\nexit {rc}\n")
    script.chmod(0o755)
    return bin_dir


async def test_every_sbatch_is_timed_at_the_slurm_chokepoint(tmp_path: Path) -> None:
    metrics = BrokerMetrics()
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/sh\n")
    ok = CliSlurmClient(SlurmConfig(bin_dir=_fake_sbatch(tmp_path, 0)), metrics.slurm_call)
    assert await ok.submit(script) == "4242"
    failing = CliSlurmClient(SlurmConfig(bin_dir=_fake_sbatch(tmp_path, 1)), metrics.slurm_call)
    with pytest.raises(SlurmError):
        await failing.submit(script)
    assert metrics.sbatch.count(("ok",)) == 1 and metrics.sbatch.count(("failed",)) == 1
    metrics.slurm_call("squeue", 0.1, True)  # other commands are not sbatch's
    assert sum(metrics.sbatch.count(k) for k in metrics.sbatch.values) == 2
    text = "\n".join(metrics.sbatch.render()) + "\n"
    assert value(parse_metrics(text), "xhpc_broker_sbatch_seconds_count", outcome="ok") == 1


@pytest.mark.adversarial
async def test_get_metrics_is_for_admins_and_the_proxy_only(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    async with TestClient(TestServer(control_app(service))) as client:
        monkeypatch.setattr(api, "peer_caller", lambda *_: MEMBER)
        resp = await client.get("/v1/metrics")
        body = await resp.json()
        assert resp.status == 403 and set(body) == {"error"}
        assert body["error"]["code"] == "forbidden"
        assert "admins and the proxy's identity" in body["error"]["message"]
        assert "xhpc_broker" not in await resp.text()
        for who in (ADMIN, PROXY, Caller(user="root", uid=0, admin=True, proxy=True)):
            monkeypatch.setattr(api, "peer_caller", lambda *_, c=who: c)
            resp = await client.get("/v1/metrics")
            assert resp.status == 200, who
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = parse_metrics(await resp.text())
            assert value(samples, "xhpc_broker_replicas", deployment="m", state="QUEUED") == 1
