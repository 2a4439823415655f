"""``GET /v1/overview`` (`xhpc top`'s one call): the broker's real service with real SQLite and
a recording Slurm stand-in, driven to a state with a READY, a STARTING and a QUEUED replica,
probes and a proxy's load; tests/data/top/overview.json was recorded from this scenario
(``python -m tests.unit.test_top_overview`` writes it again)."""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import RecordingSlurm, make
from xhpc.broker.api import control_app
from xhpc.broker.outlook import overview
from xhpc.broker.service import BrokerService
from xhpc.clock import utcnow
from xhpc.dashboard.overview import Overview
from xhpc.models import (
    AgentRegistration,
    GpuProbe,
    JobInfo,
    NodeInfo,
    ProbeReport,
    ProxyLoad,
    ReplicaState,
    ServeRequest,
)
from xhpc.slurm.parse import parse_sinfo_json

S = ReplicaState
DATA = Path(__file__).resolve().parent.parent / "data"


def _job(job_id: str, state: str, **fields: object) -> JobInfo:
    return JobInfo(
        job_id=job_id, raw_job_id=int(job_id), name=f"xhpc-{job_id}", state=state, **fields
    )  # type: ignore[arg-type]


async def scenario(service: BrokerService, slurm: RecordingSlurm, model: Path) -> None:
    """tiny-llama: 3 replicas (1 h jobs): -0 READY on n1 (20 min left), -1 STARTING on n2,
    -2 QUEUED (Resources, Slurm expects it in 12 min); probes of every node (n3's GPU 3
    unhealthy); one proxy with 3 requests in flight to -0."""
    req = ServeRequest(model=str(model), name="tiny-llama", replicas=3, time="01:00:00")
    await service.serve(req)
    now = utcnow()
    slurm.queue = [
        _job("100", "RUNNING", batch_host="n1", gres_detail=("gpu:1(IDX:0)",), gpus_idx=(0,),
             time_limit_min=60, start_time=now - timedelta(minutes=40)),
        _job("101", "RUNNING", batch_host="n2", gres_detail=("gpu:1(IDX:1)",), gpus_idx=(1,),
             time_limit_min=60, start_time=now - timedelta(minutes=1)),
        _job("102", "PENDING", reason="Resources", time_limit_min=60,
             start_time=now + timedelta(minutes=12)),
    ]  # fmt: skip
    await service.reconcile_once()
    service.agents.register(
        AgentRegistration(replica_id="tiny-llama-0", job_id="100", node="n1", host="10.0.0.1",
                          port=9000, gpus=(0,), served_model="tiny-llama")
    )  # fmt: skip
    busy = {("n1", 0): 35.0, ("n2", 1): 5.0}  # the GPUs the running jobs hold
    for node in ("n1", "n2", "n3"):
        gpus = tuple(
            GpuProbe(index=i, mem_used_mb=2048.0 if (node, i) in busy else 0.0,
                     mem_total_mb=16384.0, util_pct=busy.get((node, i), 0.0),
                     healthy=not (node == "n3" and i == 3),
                     error="Xid 79" if node == "n3" and i == 3 else None)
            for i in range(4)
        )  # fmt: skip
        service.probes.put(ProbeReport(node=node, taken_at=utcnow(), backend="fake", gpus=gpus))
    table = service.routes()
    service.drains.heard(
        ProxyLoad(proxy_id="w1", table_version=table.version, outstanding={"tiny-llama-0": 3})
    )


async def test_the_overview_holds_replicas_nodes_outlook_and_events(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await scenario(service, slurm, model_dir)
    polls = service.poller.polls
    ov = await overview(service, events=5)
    (dep,) = ov.deployments
    states = {r.replica_id: r.state for r in dep.replicas}
    assert states == {"tiny-llama-0": S.READY, "tiny-llama-1": S.STARTING, "tiny-llama-2": S.QUEUED}
    outlook = ov.outlook_of()
    assert outlook["tiny-llama-0"].in_flight == 3 and outlook["tiny-llama-1"].in_flight == 0
    # Slurm's estimate for the pending job only; the handover of the READY one, before its end.
    pending = outlook["tiny-llama-2"].start_estimate
    assert pending is not None and pending > ov.taken_at
    assert outlook["tiny-llama-0"].start_estimate is None
    ready = next(r for r in dep.replicas if r.replica_id == "tiny-llama-0")
    due = outlook["tiny-llama-0"].handover_at
    assert ready.ends_at is not None and due is not None
    assert due == ready.ends_at - timedelta(seconds=service.config.lifecycle.handover_floor_s)
    assert outlook["tiny-llama-1"].handover_at is None  # not READY: nothing to hand over yet
    assert [n.name for n in ov.nodes.nodes] == ["n1", "n2", "n3"]
    assert not ov.nodes.nodes[2].gpus[3].healthy
    assert ov.proxies == 1
    assert len(ov.events) == 5 and ov.events[-1].message.startswith("READY")
    # Built from the shared view: asking again within its age polls Slurm no more (an age no
    # slow CI machine outlasts between the two calls).
    service.config.placement.max_view_age_s = 3600.0
    await overview(service, events=5)
    assert service.poller.polls == polls


async def test_a_stopped_deployment_leaves_the_overview_and_ended_replicas_are_dropped(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await scenario(service, slurm, model_dir)
    service.lifecycle.move(service.store.replica("tiny-llama-2"), S.STOPPED, "scaled down")
    (dep,) = (await overview(service, events=0)).deployments
    assert [r.replica_id for r in dep.replicas] == ["tiny-llama-0", "tiny-llama-1"]
    await service.stop("tiny-llama")
    for r in service.store.replicas(active_only=True):
        service.lifecycle.move(r, S.STOPPED, "job ended")
    service.lifecycle.close_if_done("tiny-llama")
    assert (await overview(service, events=0)).deployments == ()


async def test_the_endpoint_answers_an_overview_and_checks_its_events_count(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    await scenario(service, slurm, model_dir)
    async with TestClient(TestServer(control_app(service))) as client:
        answer = await client.get("/v1/overview?events=3")
        assert answer.status == 200
        ov = Overview.model_validate_json(await answer.text())
        assert len(ov.events) == 3 and ov.deployments[0].name == "tiny-llama"
        for bad in ("x", "-1", "201"):
            answer = await client.get(f"/v1/overview?events={bad}")
            assert answer.status == 400, bad
            assert "events" in (await answer.json())["error"]["message"]


def _record(out: Path) -> None:  # pragma: no cover - run by hand to record the fixture
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        model = base / "models" / "m"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        nodes = parse_sinfo_json((DATA / "slurm" / "sinfo-idle.json").read_text())

        async def run() -> Overview:
            service, slurm = make(base, nodes)
            await scenario(service, slurm, model)
            return await overview(service, events=20)

        out.write_text(asyncio.run(run()).model_dump_json(indent=2) + "\n")


if __name__ == "__main__":  # pragma: no cover
    _record(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA / "top" / "overview.json")
