"""Reading an engine's schema through the runner: kept for a while, and a failure is None with
its reason (an engine Python that prints something else, or none at all); `doctor --site`'s
check of the catalog's engine configurations against it."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from tests.unit.test_broker_service import make
from xhpc.agent.local import local_engine
from xhpc.engine_config import ModelEngineConfig
from xhpc.engine_schemas import EngineSchemas
from xhpc.errors import AdmissionError, ValidationError
from xhpc.models import EngineKind, NodeInfo, ServeRequest
from xhpc.settings import EngineConfig, ModelEntry, XhpcConfig
from xhpc.sitecheck.run import check_engine_configs

SNAPSHOT = Path(__file__).resolve().parent.parent / "data" / "engines" / "vllm-schema.json"


def _python(tmp_path: Path, body: str) -> Path:
    """A stand-in for an engine's interpreter (it ignores its arguments)."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\necho "$$" >> {tmp_path}/calls\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


async def test_a_schema_is_read_once_and_kept(tmp_path: Path) -> None:
    python = _python(tmp_path, f"echo 'a warning line'; cat {SNAPSHOT}")
    schemas = EngineSchemas()
    settings = EngineConfig(python=python)
    first, second = await asyncio.gather(  # a warm-up and a serve at once: one read
        schemas.get(EngineKind.VLLM, settings), schemas.get(EngineKind.VLLM, settings)
    )
    assert first is not None and "--tool-call-parser" in first.options
    assert second == first and await schemas.get(EngineKind.VLLM, settings) == first
    assert len((tmp_path / "calls").read_text().split()) == 1  # kept, not read again
    assert await schemas.get(EngineKind.TRANSFORMERS, settings) is None  # vLLM's alone


async def test_an_engine_that_cannot_say_gives_none_and_its_reason(tmp_path: Path) -> None:
    schemas = EngineSchemas(max_age_s=0)
    broken = EngineConfig(python=_python(tmp_path, "echo 'No module named vllm' >&2; exit 1"))
    assert await schemas.get(EngineKind.VLLM, broken) is None
    assert schemas.failures[str(broken.python)] == "exit 1"
    odd = EngineConfig(python=_python(tmp_path, "echo '{}'"))
    assert await schemas.get(EngineKind.VLLM, odd) is None
    assert "no schema in its output" in schemas.failures[str(odd.python)]


async def test_doctor_checks_the_catalog_s_engine_configs_against_the_engine(
    tmp_path: Path, model_dir: Path
) -> None:
    good = ModelEngineConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    bad = ModelEngineConfig(tool_call_parser="nosuch", chat_template="missing.jinja")
    python = _python(tmp_path, f"cat {SNAPSHOT}")
    config = XhpcConfig(
        state_dir=tmp_path / "state",
        engines={"vllm": EngineConfig(python=python)},
        models={
            "good": ModelEntry(path=model_dir, engine_config=good),
            "bad": ModelEntry(path=model_dir, engine_config=bad),
            "plain": ModelEntry(path=model_dir),
        },
    )
    (row,) = await check_engine_configs(config, 30)
    assert (row.name, row.verdict.value) == ("models:engine_config", "fail")
    assert "bad: engine_config: no chat template" in row.detail
    assert "--tool-call-parser nosuch" in row.detail
    assert "good" not in row.detail
    config.models.pop("bad")
    (row,) = await check_engine_configs(config, 30)
    assert row.verdict.value == "ok" and "1 model(s) fit" in row.detail
    broken = config.model_copy(
        update={"engines": {"vllm": EngineConfig(python=_python(tmp_path, "exit 3"))}}
    )
    (row,) = await check_engine_configs(broken, 30)
    assert row.verdict.value == "warn" and "checked by their types alone" in row.detail


async def test_in_allocation_serving_takes_the_catalog_s_config_and_checks_it_first(
    tmp_path: Path, model_dir: Path
) -> None:
    """``xhpc.local``: the site catalog entry's configuration is in the engine's argv, and one
    the engine's own options refuse stops the start before any GPU is claimed or engine run."""
    good = ModelEngineConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    python = _python(tmp_path, f"cat {SNAPSHOT}")
    config = XhpcConfig(
        state_dir=tmp_path / "state",
        engines={"vllm": EngineConfig(python=python)},
        models={"tiny": ModelEntry(path=model_dir, engine="vllm", engine_config=good)},
    )
    engine = local_engine("tiny", config, gpus=0)
    assert engine.spec.args[:3] == ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    await engine._check_engine_config()  # the engine's options take it
    refused = local_engine(
        "tiny", config, gpus=0, engine_config=ModelEngineConfig(tool_call_parser="nosuch")
    )
    with pytest.raises(AdmissionError) as err:
        await refused.start()
    assert "--tool-call-parser nosuch" in str(err.value.problems)
    assert refused.engine is None and refused.gpus == ()
    with pytest.raises(ValidationError, match="applies to the vllm engine"):
        local_engine("tiny", config, gpus=0, engine="transformers")


async def test_the_broker_asks_the_engine_last_and_refuses_what_it_refuses_before_sbatch(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, slurm = make(tmp_path, idle_nodes)
    python = _python(tmp_path, f"cat {SNAPSHOT}")
    engines = {"vllm": EngineConfig(python=python)}
    service.config = service.config.model_copy(update={"engines": engines})
    nosuch = ModelEngineConfig(tool_call_parser="nosuch")
    req = ServeRequest(model=str(model_dir), engine=EngineKind.VLLM, engine_config=nosuch)
    # Refused for something else: the engine is not asked (importing it takes seconds).
    with pytest.raises(AdmissionError) as err:
        await service.serve(req.model_copy(update={"gpus": 64}))
    assert not (tmp_path / "calls").exists()
    with pytest.raises(AdmissionError) as err:
        await service.serve(req)
    assert any("--tool-call-parser nosuch" in p for p in err.value.problems), err.value.problems
    assert slurm.submitted == [] and service.store.replicas() == []
    hermes = ModelEngineConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    dep = await service.serve(req.model_copy(update={"engine_config": hermes}))
    assert slurm.submitted == ["100"] and dep.replicas
    assert len((tmp_path / "calls").read_text().split()) == 1  # read once, kept
