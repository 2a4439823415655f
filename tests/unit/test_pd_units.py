"""PD units: planning a unit as one hetjob, whole-unit admission, a unit's state from its
instances', and the broker's unit flow (one sbatch per unit, stop ends the unit, a degraded unit
is replaced, scale by whole units) with real SQLite and a recording Slurm stand-in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.unit.test_broker_service import RecordingSlurm, make
from xhpc.broker.desks.unit_desk import leader, with_het_ids
from xhpc.broker.plan.pd_planner import kv_transfer_config, plan_units
from xhpc.broker.plan.plans import JobKind
from xhpc.broker.plan.units import pd_problems, unit_state
from xhpc.catalog import resolve_model
from xhpc.clock import utcnow
from xhpc.errors import AdmissionError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    EngineKind,
    JobInfo,
    NodeInfo,
    PdRole,
    ServeRequest,
    UnitState,
)
from xhpc.settings import LifecycleConfig, PdConfig, XhpcConfig
from xhpc.store import ReplicaRow, replica_record


class UnitSlurm(RecordingSlurm):
    """sbatch of a unit's script: its directory is the unit's, not a replica's."""

    async def submit(self, script: Path) -> str:
        if script.parent.parent.name == "units":
            self.submitted.append(str(100 + len(self.submitted)))
            return self.submitted[-1]
        return await super().submit(script)


def _config(tmp_path: Path, **pd: object) -> XhpcConfig:
    return XhpcConfig(
        state_dir=tmp_path / "state", models_dir=tmp_path / "models", pd=PdConfig(**pd)
    )


def test_a_unit_is_one_hetjob_with_a_component_per_instance(
    tmp_path: Path, model_dir: Path
) -> None:
    config = _config(
        tmp_path,
        connector="NixlConnector",
        kv_buffer_device="cpu",
        prefill_args=["--block-size", "32"],
    )
    req = ServeRequest(
        model=str(model_dir),
        pd="2P1D",
        prefill_gpus=1,
        decode_gpus=2,
        decode_args=("--max-num-seqs", "4"),
    )
    model = resolve_model(req.model, config)
    plan = plan_units(
        req,
        model,
        config,
        start_index=3,
        agent_python="/py",
        broker_id="b1",
        placements=[["n1", "n2", "n3"]],
    )
    (unit,) = plan.jobs
    assert (unit.kind, unit.key) == (JobKind.UNIT, "m-u3")
    assert [i.replica_id for i in unit.hosts] == ["m-u3-p0", "m-u3-p1", "m-u3-d0"]
    assert [i.spec.het_offset for i in unit.hosts] == [0, 1, 2]
    script = unit.script
    assert script.count("#SBATCH hetjob") == 2
    assert "#SBATCH --comment=xhpc-unit:b1:m:m-u3" in script
    for g, node in enumerate(("n1", "n2", "n3")):
        assert f"srun --het-group={g} /py -I -m xhpc.agent" in script
        assert f"#SBATCH --nodelist={node}" in script
    assert script.count("#SBATCH --gres=gpu:1") == 2 and script.count("#SBATCH --gres=gpu:2") == 1
    p0, _, d0 = unit.hosts
    assert p0.spec.kv_transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                   "kv_buffer_device": "cpu"}  # fmt: skip
    assert d0.spec.kv_transfer is not None and d0.spec.kv_transfer["kv_role"] == "kv_consumer"
    # a failed KV load is recomputed by the decode, never a stream that ends without a finish
    assert d0.spec.kv_transfer["kv_load_failure_policy"] == "recompute"
    assert "--block-size" in p0.spec.args and "--block-size" not in d0.spec.args
    assert "--max-num-seqs" in d0.spec.args and p0.spec.side_channel


def test_example_connector_gets_the_units_own_directory(tmp_path: Path) -> None:
    pd = PdConfig(
        connector="ExampleConnector", extra_config={"shared_storage_path": "{unit_dir}/kv"}
    )
    cfg = kv_transfer_config(pd, PdRole.DECODE, tmp_path / "units" / "m-u0")
    assert cfg["kv_connector_extra_config"] == {"shared_storage_path": f"{tmp_path}/units/m-u0/kv"}
    assert "kv_buffer_device" not in cfg and not pd.side_channel


def _node(name: str, gpus: int) -> NodeInfo:
    return NodeInfo(name=name, address="x", state="IDLE", partitions=("gpu",), gpus_total=gpus)


def test_whole_unit_admission_names_every_problem() -> None:
    pool = [_node("n1", 2), _node("n2", 2)]
    req = ServeRequest(model="m", pd="2P2D", prefill_gpus=1, decode_gpus=4, pilot="n1")
    site = XhpcConfig(pd=PdConfig(prefill_nodes="n9"))
    problems = pd_problems(req, pool, EngineKind.TRANSFORMERS, site)
    assert any("needs the vllm engine" in p for p in problems)
    assert any("--pilot does not apply" in p for p in problems)
    assert any("no prefill instance fits" in p and "(n9)" in p for p in problems)
    assert any("no decode instance fits: 4 GPU(s)" in p for p in problems)
    assert any("a 2P2D unit needs 10 GPUs; the partition has 4" in p for p in problems)
    plain = ServeRequest(model="m", pd="1P1D")
    assert pd_problems(plain, pool, EngineKind.VLLM, XhpcConfig()) == []


def _inst(rid: str, state: str) -> ReplicaRow:
    now = utcnow()
    return ReplicaRow(
        replica_id=rid,
        deployment="m",
        idx=0,
        state=state,
        engine="vllm",
        pd_unit="m-u0",
        created_at=now,
        updated_at=now,
    )


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        (("READY", "READY"), UnitState.READY),
        (("READY", "STARTING"), UnitState.STARTING),
        (("QUEUED", "QUEUED"), UnitState.STARTING),
        (("READY", "FAILED"), UnitState.DEGRADED),
        (("LOST", "READY"), UnitState.DEGRADED),
        (("DRAINING", "STOPPED"), UnitState.STOPPING),
        (("STOPPED", "FAILED"), UnitState.ENDED),
    ],
)
def test_a_units_state_comes_from_its_instances(
    states: tuple[str, str], expected: UnitState
) -> None:
    rows = [replica_record(_inst(f"m-u0-{i}", s)) for i, s in enumerate(states)]
    assert unit_state(rows)[0] is expected


def test_components_are_found_by_leader_and_offset() -> None:
    jobs = {
        "7": JobInfo(
            job_id="7", raw_job_id=7, name="u", state="RUNNING", het_job_id=7, het_job_offset=0
        ),
        "8": JobInfo(
            job_id="8", raw_job_id=8, name="u", state="PENDING", het_job_id=7, het_job_offset=1
        ),
    }
    index = with_het_ids(jobs)
    assert index["7+0"].job_id == "7" and index["7+1"].job_id == "8"
    assert leader("7+1") == "7" and leader("12") == "12"


async def test_the_broker_runs_replaces_and_scales_whole_units(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=UnitSlurm)
    now = LifecycleConfig(backoff_s=0, restart_grace_s=0)  # the keeper replaces at once
    service.config = service.config.model_copy(update={"lifecycle": now})
    req = ServeRequest(model=str(model_dir), pd="1P1D", engine=EngineKind.VLLM)
    dep = await service.serve(req)
    assert slurm.submitted == ["100"]  # one hetjob for the unit
    assert sorted((r.role, r.job_id) for r in dep.replicas if r.role) == [
        (PdRole.DECODE, "100+1"),
        (PdRole.PREFILL, "100+0"),
    ]
    # Placed idle-first on two different nodes; their GPUs are booked in the ledger.
    assert len({r.node for r in service.store.open_reservations()}) == 2
    rows = {r.role: r for r in service.store.replicas(deployment="m")}
    assert rows["prefill"].placed_node is None  # a unit is never re-planned component-wise
    planned = json.loads((Path(str(rows["prefill"].replica_dir)) / "spec.json").read_text())
    assert planned["kv_transfer"]["kv_role"] == "kv_producer"
    # Both instances READY: the unit becomes READY at the next reconcile, then it is routed.
    for r in rows.values():
        service.agents.register(
            AgentRegistration(
                replica_id=r.replica_id,
                job_id=str(r.job_id),
                node="n1",
                host="10.0.0.1",
                port=9000,
                served_model="m",
                side_channel_port=5555,
            )
        )
    assert service.routes().routes == ()  # not before the unit is READY
    slurm.queue = [
        JobInfo(
            job_id="100",
            raw_job_id=100,
            name="u",
            state="RUNNING",
            het_job_id=100,
            het_job_offset=0,
        ),
        JobInfo(
            job_id="101",
            raw_job_id=101,
            name="u",
            state="RUNNING",
            het_job_id=100,
            het_job_offset=1,
        ),
    ]
    await service.reconcile_once()
    routes = service.routes().routes
    assert sorted(r.role for r in routes if r.role) == [PdRole.DECODE, PdRole.PREFILL]
    assert {r.unit for r in routes} == {"m-u0"}
    assert service.store.replica(rows["decode"].replica_id).side_channel_port == 5555
    # The decode instance dies: the unit is degraded, its hetjob cancelled, and the keeper
    # replaces it by the deployment's policy (always): a new unit submitted.
    service.agents.report(
        AgentReport(
            replica_id=rows["decode"].replica_id, job_id="100+1", phase="failed", detail="boom"
        )
    )
    await service.reconcile_once()
    # The live prefill drains first (its requests finish), then the hetjob is cancelled.
    await asyncio.gather(*service._draining.values())
    assert slurm.cancelled == ["100"] and slurm.submitted == ["100", "101"]
    assert service.unit_desk.units.get("m-u0").state == "ENDED"
    assert service.unit_desk.units.get("m-u1").state == "STARTING"
    assert service.routes().routes == ()
    # Scale by whole units: 1 -> 2 submits one more hetjob; the same count changes nothing.
    up = await service.scale("m", 2)
    assert len(up.added) == 2 and slurm.submitted[-1] == "102"
    assert (await service.scale("m", 2)).added == ()
    # Stopping one instance ends its whole unit (the leader's id, once).
    await service.stop("m-u1-p0")
    assert slurm.cancelled[-1] == "101"


async def test_a_unit_that_cannot_fit_is_refused_before_any_sbatch(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=UnitSlurm)
    req = ServeRequest(model=str(model_dir), pd="1P1D", decode_gpus=8, engine=EngineKind.VLLM)
    with pytest.raises(AdmissionError) as err:
        await service.serve(req)
    assert any("no decode instance fits: 8 GPU(s)" in p for p in err.value.problems)
    assert slurm.submitted == [] and service.store.replicas() == []


async def test_a_pd_request_plans_through_the_services_one_planning_entry(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes, slurm_cls=UnitSlurm)
    plan = await service.plan(ServeRequest(model=str(model_dir), pd="1P1D", engine=EngineKind.VLLM))
    assert [(job.kind, job.key) for job in plan.jobs] == [(JobKind.UNIT, "m-u0")]
    assert [r.spec.pd_role for r in plan.replicas] == [PdRole.PREFILL, PdRole.DECODE]
    assert slurm.submitted == []  # planning submits nothing
