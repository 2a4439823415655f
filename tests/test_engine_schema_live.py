"""The schema script against the installed vLLM (.venvs/vllm): it reads the engine's own options
and parser registries, and a typed engine configuration of the kind the catalog holds passes it.
Marked `engine` (it imports vLLM: seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xhpc.engine_config import ModelEngineConfig
from xhpc.engine_schema import schema_problems
from xhpc.engine_schemas import read_schema

VLLM_PY = Path(__file__).resolve().parent.parent / ".venvs" / "vllm" / "bin" / "python"

pytestmark = pytest.mark.engine


async def test_the_installed_vllm_says_its_options_and_parsers() -> None:
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-engines vllm)")
    schema = await read_schema(str(VLLM_PY))
    assert schema.engine == "vllm" and schema.version
    assert {"hermes", "llama3_json"} <= set(schema.tool_parsers)
    assert "deepseek_r1" in schema.reasoning_parsers
    assert schema.options["--enable-auto-tool-choice"].values == 0
    cfg = ModelEngineConfig(
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        max_model_len=512,
        structured_outputs={"backend": "xgrammar", "disable_any_whitespace": True},
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    assert schema_problems(cfg.argv("/w"), schema) == []
    assert schema_problems(["--tool-call-parser", "nosuch"], schema)
