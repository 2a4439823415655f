"""Deployment plans (pure); admission has its own tests (test_admission*.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from xhpc.broker.admit import admission
from xhpc.broker.plan import planner
from xhpc.broker.plan.planner import (
    DeploymentPlan,
    JobKind,
    JobPlan,
    ReplicaPlan,
    choose_engine,
    plan_deployment,
)
from xhpc.catalog import ResolvedModel
from xhpc.config import EngineConfig, SlurmConfig, XhpcConfig
from xhpc.models import AgentSpec, EngineKind, ReplicaConfig, ServeRequest
from xhpc.render import SbatchParams

VLLM = EngineKind.VLLM
SECRETISH = re.compile(r"token|secret|password|passwd|credential|api_?key|auth", re.IGNORECASE)


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
        assert r.sbatch.comment == f"xhpc:default:tiny-llama:{r.replica_id}"
        assert r.sbatch.output == str(r.replica_dir / "slurm-%j.out")
        assert r.spec.broker_file == str(state / "broker.json")


def test_plan_spec_and_sbatch_fields(config: XhpcConfig, model: ResolvedModel) -> None:
    (job,) = plan(
        config,
        model,
        gpus=2,
        time="00:30:00",
        nodelist="n2",
        engine_args=("--max-model-len", "512"),
    ).jobs
    assert (job.kind, job.key) == (JobKind.REPLICA, "tiny-llama-3")
    assert job.job_dir == job.hosts[0].replica_dir
    (r,) = job.hosts
    assert r.spec.args == ("--dtype", "float16", "--max-model-len", "512")
    assert r.spec.env == {"VLLM_X": "1"}
    assert r.spec.model_path == str(model.path)
    assert (r.sbatch.gpus, r.sbatch.time, r.sbatch.nodelist) == (2, "00:30:00", "n2")
    assert (r.sbatch.partition, r.sbatch.cpus, r.sbatch.mem_mb) == ("gpu", 2, 8000)
    exec_lines = [ln for ln in job.script.splitlines() if not ln.startswith("#")]
    assert [shlex.split(ln) for ln in exec_lines if ln.strip()] == [
        ["exec", "/venv/bin/python", "-I", "-m", "xhpc.agent", str(r.replica_dir)]
    ]
    assert "#SBATCH --gres=gpu:2" in job.script.splitlines()


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
    for cls in (AgentSpec, SbatchParams, ReplicaPlan, JobPlan, DeploymentPlan):
        assert not [f for f in cls.model_fields if SECRETISH.search(f)], cls.__name__
    p = plan(config, model, replicas=2)
    keys = _keys(p.model_dump(mode="json"))
    assert "spec" in keys and "env" in keys
    assert not [k for k in keys if SECRETISH.search(k)]
    for r in p.replicas:
        assert not [k for k in r.spec.env if SECRETISH.search(k)]
    for script in p.scripts().values():
        commands = [
            ln.replace(str(tmp_path), "<tmp>")
            for ln in script.splitlines()
            if not ln.startswith("# ")
        ]  # the explanatory comment names the token file
        assert commands and not [ln for ln in commands if SECRETISH.search(ln)]
        assert "Bearer" not in script


def test_admission_is_re_exported_for_its_callers() -> None:
    assert planner.admission_problems is admission.admission_problems


def test_replica_configs_shape_each_replica(config: XhpcConfig, model: ResolvedModel) -> None:
    request = ServeRequest(
        model="tiny-llama",
        replicas=3,
        gpus=2,
        gpu_type="a100",
        nodelist="n[1-3]",
        replica_configs=(
            ReplicaConfig(node="n3", gpus=1),
            ReplicaConfig(),
            ReplicaConfig(gpu_type="h100"),
        ),
    )
    p = plan_deployment(
        request, model, config, start_index=0, agent_python="/py", placements=["n1", "n2", None]
    )
    got = [(r.node, r.sbatch.nodelist, r.sbatch.gpus, r.sbatch.gres) for r in p.replicas]
    assert got == [
        ("n3", "n3", 1, "gpu:a100:1"),  # the replica's own node wins over the placement
        ("n2", "n2", 2, "gpu:a100:2"),
        (None, "n[1-3]", 2, "gpu:h100:2"),
    ]
    assert "#SBATCH --gres=gpu:a100:1" in p.jobs[0].script.splitlines()
