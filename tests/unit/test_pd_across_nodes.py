"""PD units whose prefill or decode side spans nodes, the pure parts and the broker's flow: the
unit's hetjob (a component of N nodes, an agent per node), its instances' parallel sizes and
engine commands, whole-unit admission, and placement over node sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_broker_service import make
from tests.unit.test_pd_units import UnitSlurm, _inst
from xhpc.agent.engines import Rank, engine_launch
from xhpc.broker.admit.admission import admission_problems
from xhpc.broker.admit.members import unit_member
from xhpc.broker.plan.pd_planner import plan_units
from xhpc.broker.plan.units import pd_problems
from xhpc.broker.service import BrokerService
from xhpc.catalog import resolve_model
from xhpc.errors import AdmissionError
from xhpc.models import AgentSpec, EngineKind, NodeInfo, PdRole, ServeRequest
from xhpc.placement.layout import parallel_sizes
from xhpc.settings import MultiNodeConfig, PdConfig, XhpcConfig
from xhpc.store import replica_record


def _config(tmp_path: Path, whole: bool = True) -> XhpcConfig:
    return XhpcConfig(
        state_dir=tmp_path / "state",
        models_dir=tmp_path / "models",
        pd=PdConfig(connector="NixlConnector", kv_buffer_device="cpu"),
        multi_node=MultiNodeConfig(enabled=True, whole_nodes=whole),
    )


def _node(name: str, gpus: int = 4) -> NodeInfo:
    return NodeInfo(name=name, address="x", state="IDLE", partitions=("gpu",), gpus_total=gpus)


def test_a_prefill_side_across_two_nodes_is_one_component_of_two_nodes(
    tmp_path: Path, model_dir: Path
) -> None:
    config = _config(tmp_path)
    req = ServeRequest(model=str(model_dir), pd="1P1D", gpus=2, prefill_nodes=2)
    plan = plan_units(
        req,
        resolve_model(req.model, config),
        config,
        start_index=0,
        agent_python="/py",
        broker_id="b1",
        placements=[["n1,n2", "n3"]],
    )
    (unit,) = plan.jobs
    p0, d0 = unit.hosts
    script = unit.script
    prefill, decode = script.split("#SBATCH hetjob")
    assert "#SBATCH --nodes=2" in prefill and "#SBATCH --ntasks-per-node=1" in prefill
    assert "#SBATCH --exclusive" in prefill and "#SBATCH --nodelist=n1,n2" in prefill
    assert "#SBATCH --nodes=1" in decode and "#SBATCH --ntasks=1" in decode
    assert "--exclusive" not in decode.split("# xhpc PD unit")[0]
    # One step per component; the spanning one an agent per node, ended whole on a bad exit.
    assert "srun --het-group=0 --ntasks-per-node=1 --kill-on-bad-exit=1 /py -I -m xhpc.agent" in (
        script
    )
    assert "srun --het-group=1 /py -I -m xhpc.agent" in script
    # Its agents span two nodes, the pipeline across them, tensor parallel inside each.
    assert (p0.spec.nodes, p0.spec.execute_timeout_s) == (2, 60.0)
    assert parallel_sizes(p0.spec.args) == {"tp": 2, "pp": 2}
    assert (d0.spec.nodes, parallel_sizes(d0.spec.args)) == (1, {})
    # Its row and reservation: the head, and the set.
    assert (p0.node, p0.node_set) == ("n1", ("n1", "n2"))
    assert (d0.node, d0.node_set) == ("n3", ("n3",))
    assert p0.sbatch.nodes == 2 and p0.sbatch.exclusive
    # A pipelined prefill's KV goes by NIXL's push mode, on both sides of the unit.
    for inst in (p0, d0):
        assert inst.spec.kv_transfer is not None
        assert inst.spec.kv_transfer["kv_connector"] == "NixlPushConnector"


def test_a_decode_side_across_nodes_is_tensor_parallel_only(
    tmp_path: Path, model_dir: Path
) -> None:
    config = _config(tmp_path, whole=False)
    req = ServeRequest(model=str(model_dir), pd="1P1D", decode_nodes=2)
    plan = plan_units(
        req, resolve_model(req.model, config), config, start_index=0, agent_python="/py",
        broker_id="b1",
    )  # fmt: skip
    p0, d0 = plan.jobs[0].hosts
    assert (p0.spec.nodes, d0.spec.nodes) == (1, 2)
    assert parallel_sizes(d0.spec.args) == {"tp": 2}
    assert "#SBATCH --exclusive" not in plan.jobs[0].script  # the site shares nodes
    assert d0.spec.kv_transfer is not None  # no pipeline: the site's connector
    assert d0.spec.kv_transfer["kv_connector"] == "NixlConnector"


POOL = [_node("n1"), _node("n2"), _node("n3")]


def _problems(req: ServeRequest, **multi: Any) -> list[str]:
    config = XhpcConfig(multi_node=MultiNodeConfig(**multi))
    return pd_problems(req, POOL, EngineKind.VLLM, config)


def test_whole_unit_admission_checks_each_side_that_spans_nodes() -> None:
    req = ServeRequest(model="m", pd="1P1D", prefill_nodes=2)
    assert _problems(req, enabled=True) == []
    off = _problems(req)
    assert any("--prefill-nodes 2" in p and "[multi_node] enabled = false" in p for p in off)
    piped = req.model_copy(update={"decode_nodes": 2, "decode_args": ("-pp", "2")})
    found = _problems(piped, enabled=True)
    assert any("--decode-nodes 2" in p and "tensor parallelism only" in p for p in found), found
    wrong = req.model_copy(update={"prefill_args": ("--tensor-parallel-size", "1")})
    found = _problems(wrong, enabled=True)
    assert any(p.startswith("prefill: tensor x pipeline parallel size 1 x 1") for p in found)
    wide = req.model_copy(update={"prefill_nodes": 4})
    found = _problems(wide, enabled=True)
    assert any("prefill: --nodes 4 needs 4 usable nodes" in p for p in found), found
    # A unit's instances never share a node: three nodes hold 1P1D with a 2-node prefill, not
    # with a 2-node decode as well.
    both = req.model_copy(update={"decode_nodes": 2})
    assert any("needs 4 nodes" in p and "has 3 usable" in p for p in _problems(both, enabled=True))
    # Spanning nodes counts every node's GPUs toward the unit's.
    big = ServeRequest(model="m", pd="1P1D", gpus=4, prefill_nodes=3)
    assert any("needs 16 GPUs; the partition has 12" in p for p in _problems(big, enabled=True))


def test_per_side_nodes_need_pd() -> None:
    config = XhpcConfig(multi_node=MultiNodeConfig(enabled=True))
    req = ServeRequest(model="m", decode_nodes=2)
    found = admission_problems(req, POOL, config, EngineKind.VLLM)
    assert "--decode-nodes applies to --pd units only" in found


def test_every_rank_of_a_pd_instance_gets_its_connector_and_only_the_head_its_side_channel(
    tmp_path: Path,
) -> None:
    spec = AgentSpec(
        replica_id="m-u0-p0",
        deployment="m",
        engine=EngineKind.VLLM,
        model_path="/models/m",
        served_model="m",
        broker_file="/state/broker.json",
        nodes=2,
        pd_role=PdRole.PREFILL,
        kv_transfer={"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
        side_channel=True,
    )
    for rank, side in ((0, 5555), (1, None)):
        out = engine_launch(
            spec,
            host="0.0.0.0",
            port=8123,
            node_address="10.77.0.12",
            tmp_dir=tmp_path,
            job_env={"PATH": "/usr/bin"},
            side_channel_port=side,
            rank=Rank(rank=rank, nodes=2, master_addr="10.77.0.11", master_port=29500),
        )
        argv = list(out.argv)
        kv = argv[argv.index("--kv-transfer-config") + 1]
        assert '"kv_role": "kv_producer"' in kv
        assert ("--headless" in argv) is (rank == 1)
        assert out.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") == (str(side) if side else None)


def _spanning(
    tmp_path: Path, nodes: list[NodeInfo], model_dir: Path
) -> tuple[BrokerService, UnitSlurm, ServeRequest]:
    """A broker on a site that allows instances across nodes (sharing nodes), and a 1P1D
    request whose prefill spans two of them."""
    service, slurm = make(tmp_path, nodes, slurm_cls=UnitSlurm)
    service.config = service.config.model_copy(
        update={"multi_node": MultiNodeConfig(enabled=True, whole_nodes=False)}
    )
    req = ServeRequest(model=str(model_dir), pd="1P1D", prefill_nodes=2, engine=EngineKind.VLLM)
    assert isinstance(slurm, UnitSlurm)
    return service, slurm, req


async def test_the_broker_places_a_spanning_side_on_a_node_set_of_its_own(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm, req = _spanning(tmp_path, idle_nodes, model_dir)
    plan = await service.plan(req)
    p0, d0 = plan.replicas
    assert len(p0.node_set) == 2 and len(d0.node_set) == 1
    assert not set(p0.node_set) & set(d0.node_set)  # three nodes: no side shares one
    await service.serve(req)
    assert slurm.submitted == ["100"]
    booked = {r.replica_id: r.nodes for r in service.store.open_reservations()}
    assert len(booked["m-u0-p0"]) == 2 and len(booked["m-u0-d0"]) == 1
    # Sets that no longer fit are refused whole, before any sbatch.
    wide = req.model_copy(update={"name": "w", "prefill_nodes": 4})
    with pytest.raises(AdmissionError) as err:
        await service.serve(wide)
    assert any("--nodes 4 needs 4 usable nodes" in p for p in err.value.problems)
    assert slurm.submitted == ["100"]


async def test_a_units_replacement_keeps_off_the_node_that_failed_it(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _, req = _spanning(tmp_path, idle_nodes, model_dir)
    plain = req.model_copy(update={"prefill_nodes": None})
    p0, d0 = (await service.plan(plain, avoid=("n1",))).replicas
    assert sorted((p0.node or "", d0.node or "")) == ["n2", "n3"]
    # A unit that needs every node: the avoided one only where nothing else is left, and never
    # a node another of its components has (Slurm refuses a hetjob whose node lists overlap).
    p0, d0 = (await service.plan(req, avoid=("n1",))).replicas
    assert sorted(p0.node_set) == ["n2", "n3"] and d0.node_set == ("n1",)


def test_a_failed_unit_names_the_node_its_replacement_avoids() -> None:
    lost = _inst("m-u0-p0", "FAILED").model_copy(update={"node": "n2"})
    alive = _inst("m-u0-d0", "READY").model_copy(update={"node": "n3"})
    member = unit_member("m-u0", [replica_record(lost), replica_record(alive)])
    assert (member.state.value, member.node) == ("FAILED", "n2")
    serving = unit_member("m-u0", [replica_record(alive)])
    assert serving.node is None


def test_a_dry_run_with_no_broker_renders_a_pd_unit_as_its_hetjob_and_admits_it_whole(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`xhpc serve MODEL --pd 1P1D --dry-run` with no broker plans here, as the broker's PD front
    does: one heterogeneous job per unit (not plain scripts), refused whole where a side cannot
    run."""
    from xhpc.cli.daemons import local_dry_run
    from xhpc.slurm.client import CliSlurmClient

    async def nodes(self: CliSlurmClient) -> list[NodeInfo]:
        return [_node("n1"), _node("n2"), _node("n3")]

    monkeypatch.setattr(CliSlurmClient, "nodes", nodes)
    config = _config(tmp_path)
    req = ServeRequest(model=str(model_dir), engine=EngineKind.VLLM, pd="1P1D", prefill_nodes=2)
    (script,) = local_dry_run(config, req).values()
    assert script.count("#SBATCH hetjob") == 1
    assert "--het-group=0" in script and "--het-group=1" in script
    assert "#SBATCH --nodes=2" in script  # the prefill side spans two nodes
    too_big = req.model_copy(update={"prefill_nodes": 4})
    with pytest.raises(AdmissionError, match="node"):
        local_dry_run(config, too_big)
