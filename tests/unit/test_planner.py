"""Admission checks against the captured cluster view, and deployment plans (pure)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pydantic import ValidationError as PydanticValidationError

from xhpc.broker.planner import (
    DeploymentPlan,
    ReplicaPlan,
    admission_problems,
    choose_engine,
    plan_deployment,
)
from xhpc.catalog import ResolvedModel
from xhpc.config import EngineConfig, SlurmConfig, XhpcConfig
from xhpc.models import AgentSpec, EngineKind, NodeInfo, ServeRequest
from xhpc.render import SbatchParams

VLLM = EngineKind.VLLM
SECRETISH = re.compile(r"token|secret|password|passwd|credential|api_?key|auth", re.IGNORECASE)


def problems(
    req: ServeRequest,
    nodes: list[NodeInfo],
    config: XhpcConfig | None = None,
    engine: EngineKind = VLLM,
) -> list[str]:
    return admission_problems(req, nodes, config or XhpcConfig(), engine)


# -- admission ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_fitting_request_is_admitted(idle_nodes: list[NodeInfo], gpus: int) -> None:
    assert problems(ServeRequest(model="m", gpus=gpus, partition="gpu"), idle_nodes) == []


def test_zero_gpus_is_refused_by_the_request_model() -> None:
    with pytest.raises(PydanticValidationError):
        ServeRequest(model="m", gpus=0)


def test_more_gpus_than_any_node(idle_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", gpus=5), idle_nodes)
    assert "--gpus 5 is more than any node has (largest: 4 GPUs)" in found


def test_unknown_partition_lists_known_ones(idle_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", partition="cpu"), idle_nodes)
    assert found == ["unknown partition 'cpu' (known: gpu)"]


def test_partition_from_config(idle_nodes: list[NodeInfo]) -> None:
    config = XhpcConfig(slurm=SlurmConfig(partition="nope"))
    assert problems(ServeRequest(model="m"), idle_nodes, config) == [
        "unknown partition 'nope' (known: gpu)"
    ]


def test_unknown_node_in_nodelist(idle_nodes: list[NodeInfo]) -> None:
    assert problems(ServeRequest(model="m", nodelist="n2"), idle_nodes) == []
    found = problems(ServeRequest(model="m", nodelist="n1,n9,n10"), idle_nodes)
    assert found == ["unknown node(s) n9, n10 in the partition"]


def test_drained_nodes_are_not_usable(busy_nodes: list[NodeInfo]) -> None:
    drained = [n for n in busy_nodes if n.name == "n3"]
    assert problems(ServeRequest(model="m"), drained) == [
        "no usable node (all are down, drained or too small)"
    ]
    # Busy but healthy nodes still admit: the job waits in the queue.
    assert problems(ServeRequest(model="m", gpus=4), busy_nodes) == []


def test_all_problems_are_reported_at_once(idle_nodes: list[NodeInfo]) -> None:
    found = problems(
        ServeRequest(model="m", gpus=8, nodelist="n1,n7"), idle_nodes, engine=EngineKind.COMMAND
    )
    assert found == [
        "--gpus 8 is more than any node has (largest: 4 GPUs)",
        "unknown node(s) n7 in the partition",
        "node n1 has only 4 GPUs",
        "engine 'command' has no command configured in the site config",
    ]
    found = problems(ServeRequest(model="m", gpus=1, partition="cpu", nodelist="n1"), idle_nodes)
    assert len(found) == 2
    assert found[0].startswith("unknown partition 'cpu'")
    assert "unknown node(s) n1 in the partition" in found


def test_pinning_to_a_drained_node_is_refused(busy_nodes: list[NodeInfo]) -> None:
    found = problems(ServeRequest(model="m", gpus=1, nodelist="n1,n3"), busy_nodes)
    assert found == ["node n3 is not usable (MIXED+DRAIN: test)"]


def test_engine_python_must_exist(idle_nodes: list[NodeInfo], tmp_path: Path) -> None:
    config = XhpcConfig(engines={VLLM: EngineConfig(python=tmp_path / "nope" / "python")})
    (found,) = problems(ServeRequest(model="m"), idle_nodes, config)
    assert "does not exist" in found and "nope" in found


def test_no_nodes_at_all_reports_nothing_about_gpus() -> None:
    assert problems(ServeRequest(model="m", gpus=2), []) == []


# -- planning -------------------------------------------------------------------------------------
@pytest.fixture
def config(tmp_path: Path) -> XhpcConfig:
    return XhpcConfig(
        state_dir=tmp_path / "state",
        slurm=SlurmConfig(partition="gpu", cpus_per_replica=2, mem_per_replica_mb=8000),
        engines={VLLM: EngineConfig(args=["--dtype", "float16"], env={"VLLM_X": "1"})},
    )


@pytest.fixture
def model(tmp_path: Path) -> ResolvedModel:
    return ResolvedModel(name="tiny-llama", path=tmp_path / "models" / "tiny-llama")


def plan(config: XhpcConfig, model: ResolvedModel, **req: object) -> DeploymentPlan:
    request = ServeRequest.model_validate({"model": "tiny-llama", **req})
    return plan_deployment(request, model, config, start_index=3, agent_python="/venv/bin/python")


def test_choose_engine_order(config: XhpcConfig, model: ResolvedModel) -> None:
    req = ServeRequest(model="m")
    assert choose_engine(req, model, config) is VLLM
    typed = model.model_copy(update={"engine": EngineKind.TRANSFORMERS})
    assert choose_engine(req, typed, config) is EngineKind.TRANSFORMERS
    forced = ServeRequest(model="m", engine=EngineKind.COMMAND)
    assert choose_engine(forced, typed, config) is EngineKind.COMMAND


def test_plan_replica_ids_and_indexes(config: XhpcConfig, model: ResolvedModel) -> None:
    p = plan(config, model, replicas=3)
    assert p.name == "tiny-llama" and p.engine is VLLM
    assert [(r.replica_id, r.index) for r in p.replicas] == [
        ("tiny-llama-3", 3),
        ("tiny-llama-4", 4),
        ("tiny-llama-5", 5),
    ]
    state = config.resolved_state_dir
    for r in p.replicas:
        assert r.replica_dir == state / "replicas" / r.replica_id
        assert r.sbatch.job_name == f"xhpc-{r.replica_id}"
        assert r.sbatch.comment == f"xhpc:tiny-llama:{r.replica_id}"
        assert r.sbatch.output == str(r.replica_dir / "slurm-%j.out")
        assert r.spec.broker_file == str(state / "broker.json")


def test_plan_spec_and_sbatch_fields(config: XhpcConfig, model: ResolvedModel) -> None:
    (r,) = plan(
        config,
        model,
        gpus=2,
        time="00:30:00",
        nodelist="n2",
        engine_args=("--max-model-len", "512"),
    ).replicas
    assert r.spec.args == ("--dtype", "float16", "--max-model-len", "512")
    assert r.spec.env == {"VLLM_X": "1"}
    assert r.spec.model_path == str(model.path)
    assert (r.sbatch.gpus, r.sbatch.time, r.sbatch.nodelist) == (2, "00:30:00", "n2")
    assert (r.sbatch.partition, r.sbatch.cpus, r.sbatch.mem_mb) == ("gpu", 2, 8000)
    exec_lines = [ln for ln in r.script.splitlines() if not ln.startswith("#")]
    assert [shlex.split(ln) for ln in exec_lines if ln.strip()] == [
        ["exec", "/venv/bin/python", "-m", "xhpc.agent", str(r.replica_dir)]
    ]
    assert "#SBATCH --gres=gpu:2" in r.script.splitlines()


def test_plan_uses_default_time(config: XhpcConfig, model: ResolvedModel) -> None:
    (r,) = plan(config, model).replicas
    assert r.sbatch.time == config.slurm.default_time


def _keys(value: object) -> list[str]:
    if isinstance(value, dict):
        return [*map(str, value), *(k for v in value.values() for k in _keys(v))]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_plan_holds_nothing_secret(
    config: XhpcConfig, model: ResolvedModel, tmp_path: Path
) -> None:
    """Tokens are made by the broker at submit time and written owner-only; never planned."""
    for cls in (AgentSpec, SbatchParams, ReplicaPlan, DeploymentPlan):
        assert not [f for f in cls.model_fields if SECRETISH.search(f)], cls.__name__
    p = plan(config, model, replicas=2)
    keys = _keys(p.model_dump(mode="json"))
    assert "spec" in keys and "env" in keys
    assert not [k for k in keys if SECRETISH.search(k)]
    for r in p.replicas:
        assert not [k for k in r.spec.env if SECRETISH.search(k)]
        commands = [
            ln.replace(str(tmp_path), "<tmp>")
            for ln in r.script.splitlines()
            if not ln.startswith("# ")
        ]  # the explanatory comment names the token file
        assert commands and not [ln for ln in commands if SECRETISH.search(ln)]
        assert "Bearer" not in r.script
