"""The agent's pure helpers: GPU lists from the job env, and how each engine is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xhpc.agent.agent import job_gpus, parse_gpu_list
from xhpc.agent.engines import PASS_ENV, EngineLaunch, engine_launch
from xhpc.errors import EngineError
from xhpc.models import AgentSpec, EngineKind

JOB_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_GPUS": "2,3",
    "SECRET": "x",
    "AWS_SECRET_ACCESS_KEY": "y",
    "HF_TOKEN": "hf_z",
    "LD_PRELOAD": "/evil.so",
    "PYTHONPATH": "/somewhere",
}
FIXED_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


def spec(engine: EngineKind = EngineKind.VLLM, **kw: Any) -> AgentSpec:
    fields: dict[str, Any] = {
        "replica_id": "m-0",
        "deployment": "m",
        "engine": engine,
        "model_path": "/models/m",
        "served_model": "m",
        "broker_file": "/state/broker.json",
        **kw,
    }
    return AgentSpec(**fields)


def launch(s: AgentSpec, tmp_path: Path, env: dict[str, str] | None = None) -> EngineLaunch:
    return engine_launch(
        s,
        host="0.0.0.0",
        port=8123,
        node_address="10.77.0.12",
        tmp_dir=tmp_path,
        job_env=JOB_ENV if env is None else env,
    )


# -- GPU lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,1", (0, 1)),
        ("0-2", (0, 1, 2)),
        ("0-1,3", (0, 1, 3)),
        (" 2 , 5 ", (2, 5)),
        ("", ()),
        (None, ()),
        ("garbage", ()),
        ("0,x,2", (0, 2)),
        ("a-b", ()),
        ("GPU-8f3c1a2b-0d9e", ()),  # UUIDs are not indexes
        ("NoDevFiles", ()),
    ],
)
def test_parse_gpu_list(value: str | None, expected: tuple[int, ...]) -> None:
    assert parse_gpu_list(value) == expected


def test_job_gpus_prefers_slurm_job_gpus() -> None:
    assert job_gpus({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == (2, 3)
    assert job_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == (0, 1)
    assert job_gpus({}) == ()


# -- environment ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(EngineKind))
def test_engine_env_is_allow_listed(kind: EngineKind, tmp_path: Path) -> None:
    s = spec(kind, command=("{python}", "-m", "srv") if kind is EngineKind.COMMAND else ())
    env = launch(s, tmp_path).env
    for name in ("SECRET", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "LD_PRELOAD", "PYTHONPATH"):
        assert name not in env
    passed = {k for k in env if k in JOB_ENV}
    assert passed == {k for k in PASS_ENV if k in JOB_ENV}
    assert all(env[k] == JOB_ENV[k] for k in passed)
    assert FIXED_ENV.items() <= env.items()
    assert "OMP_NUM_THREADS" not in env


def test_cpu_only_limits_threads(tmp_path: Path) -> None:
    env = launch(spec(cpu_only=True), tmp_path).env
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("1", "1")


def test_spec_env_is_added_last(tmp_path: Path) -> None:
    env = launch(spec(env={"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "0"}), tmp_path).env
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert env["HF_HUB_OFFLINE"] == "0"


def test_empty_job_env(tmp_path: Path) -> None:
    env = launch(spec(), tmp_path, env={}).env
    assert not set(PASS_ENV) & set(env)


# -- argv per engine ------------------------------------------------------------------------------
def test_vllm_launch(tmp_path: Path) -> None:
    out = launch(spec(python="/envs/vllm/bin/python", args=("--dtype", "half")), tmp_path)
    assert out.argv == (
        "/envs/vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/m",
        "--served-model-name",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "8123",
        "--dtype",
        "half",
    )
    assert out.served_model == "m"
    assert out.env["VLLM_HOST_IP"] == "10.77.0.12"
    assert out.env["VLLM_NO_USAGE_STATS"] == "1"
    assert out.env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")


def test_vllm_without_python_uses_python3(tmp_path: Path) -> None:
    assert launch(spec(), tmp_path).argv[0] == "python3"


def test_transformers_launch(tmp_path: Path) -> None:
    out = launch(
        spec(EngineKind.TRANSFORMERS, python="/envs/tf/bin/python", args=("-x",)), tmp_path
    )
    assert out.argv[0] == "/envs/tf/bin/transformers"
    assert out.argv[1] == "serve"
    assert "/models/m" in out.argv
    assert out.argv[out.argv.index("--host") + 1] == "0.0.0.0"
    assert out.argv[out.argv.index("--port") + 1] == "8123"
    assert out.argv[-1] == "-x"
    # `transformers serve` names the model by the path it was given.
    assert out.served_model == "/models/m"
    assert not any(k.startswith("VLLM_") for k in out.env)


def test_command_engine_fills_placeholders(tmp_path: Path) -> None:
    s = spec(
        EngineKind.COMMAND,
        python="/p/bin/python",
        command=(
            "{python}",
            "-m",
            "fake_engine",
            "--bind={host}:{port}",
            "{model_path}",
            "--name",
            "{served_model}",
            "--literal={{braces}}",
        ),
        args=("--extra",),
    )
    out = launch(s, tmp_path)
    assert out.argv == (
        "/p/bin/python",
        "-m",
        "fake_engine",
        "--bind=0.0.0.0:8123",
        "/models/m",
        "--name",
        "m",
        "--literal={braces}",
        "--extra",
    )
    assert out.served_model == "m"


def test_command_engine_does_not_reinterpret_values(tmp_path: Path) -> None:
    s = spec(
        EngineKind.COMMAND, model_path="/models/{port}; $(id)", command=("srv", "{model_path}")
    )
    assert launch(s, tmp_path).argv == ("srv", "/models/{port}; $(id)")


@pytest.mark.parametrize("part", ["{nope}", "{0}", "{port", "{port!z}"])
def test_command_engine_bad_placeholder(tmp_path: Path, part: str) -> None:
    with pytest.raises(EngineError, match="placeholder"):
        launch(spec(EngineKind.COMMAND, command=("srv", part)), tmp_path)


def test_command_engine_needs_a_command(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="command"):
        launch(spec(EngineKind.COMMAND), tmp_path)


async def test_a_missing_engine_environment_names_the_path_and_the_command(
    tmp_path: Path,
) -> None:
    from xhpc.agent.launch import start_engine

    missing = tmp_path / "venvs" / "transformers" / "bin" / "python"
    with pytest.raises(EngineError) as info:
        await start_engine(
            spec(EngineKind.TRANSFORMERS, python=str(missing)),
            env=JOB_ENV,
            secret=None,
            host="127.0.0.1",
            node_address="127.0.0.1",
            tmp_dir=tmp_path,
            output=tmp_path / "engine.log",
        )
    line = info.value.one_line()
    assert f"cannot start the engine {missing.parent}/" in line
    assert "`scripts/setup-engines transformers`" in line
    assert "[engines.transformers] python" in line
