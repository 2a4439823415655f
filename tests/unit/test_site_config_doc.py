"""docs/site-config.md is generated from the settings' models and stays in step with them; the
example GPU site file loads and validates."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from xhpc import settings_doc
from xhpc.config import load_config
from xhpc.models import EngineKind
from xhpc.settings import Section, XhpcConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "site-config.md"
EXAMPLE = ROOT / "xhpc" / "data" / "site.example.toml"


def test_the_reference_is_what_the_models_say() -> None:
    assert DOC.read_text() == settings_doc.render(), "run scripts/site-config-doc"
    assert settings_doc.main(["--check", str(DOC)]) == 0


def test_every_key_of_every_section_is_described(tmp_path: Path) -> None:
    text = settings_doc.render()
    for heading, model, _ in settings_doc.SECTIONS:
        body = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
                continue
            if name in ("engines", "models", "layouts", "engine_config", "lora"):  # own sections
                continue
            assert info.description, f"{model.__name__}.{name}"
            assert f"| `{name}` |" in body, (heading, name)
    assert "| `partition` | string | unset |" in text
    assert '| `auth` | "keys" \\| "none" | `"keys"` |' in text
    assert "| `gpus` | integer (≥ 1, ≤ 64) | unset |" in text


def test_a_stale_doc_or_an_undescribed_key_fails(tmp_path: Path) -> None:
    stale = tmp_path / "site-config.md"
    stale.write_text(settings_doc.render().replace("`[slurm]`", "`[slurm-old]`"))
    assert settings_doc.main(["--check", str(stale)]) == 1
    assert settings_doc.main(["--check", str(tmp_path / "absent")]) == 1

    class Bare(Section):
        mode: Literal["a", "b"] = "a"
        limit: int = Field(default=1, ge=0, description="A limit.")

    with pytest.raises(ValueError, match=r"Bare\.mode has no description"):
        settings_doc.section("x", Bare, "")
    assert settings_doc.main([str(stale)]) == 0
    assert stale.read_text() == settings_doc.render()


@pytest.mark.parametrize(
    ("annotation", "name"),
    [
        (int | None, "integer"),
        (list[str], "array of strings"),
        (tuple[Path, ...], "array of paths"),
        (dict[str, float], "table of numbers"),
        (Literal["x", "y"], '"x" \\| "y"'),
        (EngineKind, '"vllm" \\| "transformers" \\| "command"'),
    ],
)
def test_type_names(annotation: object, name: str) -> None:
    assert settings_doc.type_name(annotation) == name


def test_the_gpu_site_example_loads(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "no-user-config")}
    config, sources = load_config(EXAMPLE, env=env)
    assert isinstance(config, XhpcConfig) and sources[-1] == str(EXAMPLE)
    assert config.cpu_only is False and config.default_engine is EngineKind.VLLM
    assert config.slurm.partition == "gpu"
    assert config.state_dir == Path("/gpfs/xhpc/state")
    assert config.resolved_db_path == Path("/var/lib/xhpc/xhpc.db")
    assert config.engine(EngineKind.VLLM).python == Path("/opt/xhpc/venvs/vllm/bin/python")
    qwen = config.models["qwen2.5-72b-instruct"]
    assert qwen.gpus == 4 and "--tensor-parallel-size" in qwen.engine_args
    assert qwen.weights_path(config.models_dir) == Path("/gpfs/models/Qwen2.5-72B-Instruct")
