"""A model's typed engine configuration: its argv elements, its own checks, the installed engine's
schema (a snapshot of vLLM 0.32's, read from the engine by ``SCHEMA_SCRIPT``), and the way it
travels from a catalog entry through the request to the agent's spec and admission."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from xhpc.broker.plan.planner import plan_deployment
from xhpc.catalog import expand_request, resolve_model
from xhpc.engine_config import ModelEngineConfig
from xhpc.engine_schema import EngineSchema, engine_config_problems, schema_problems
from xhpc.models import EngineKind, ServeRequest
from xhpc.settings import ModelEntry, XhpcConfig

SCHEMA = EngineSchema.model_validate_json(
    (Path(__file__).resolve().parent.parent / "data" / "engines" / "vllm-schema.json").read_text()
)
TOOLS = ModelEngineConfig(
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
    chat_template="tool_chat_template.jinja",
    max_model_len=2048,
    speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    structured_outputs={"backend": "xgrammar", "disable_any_whitespace": True},
    limit_mm_per_prompt={"image": 0},
)


def test_each_field_is_argv_elements_and_json_values_are_one_element_each() -> None:
    argv = TOOLS.argv("/w/tiny")
    assert argv[:3] == ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    assert argv[3:5] == ("--chat-template", "/w/tiny/tool_chat_template.jinja")
    spec = argv[argv.index("--speculative-config") + 1]
    assert json.loads(spec) == TOOLS.speculative_config
    guided = json.loads(argv[argv.index("--structured-outputs-config") + 1])
    assert guided == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert ModelEngineConfig().argv("/w") == ()


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_call_parser": "hermes; id"},
        {"tool_call_parser": "--enable-lora"},
        {"reasoning_parser": "a b"},
        {"quantization": "$(id)"},
        {"chat_template": "../../etc/shadow"},
        {"chat_template": "-x"},
        {"chat_template": "t\n.jinja"},
        {"chat_template": "/srv/xhpc/control.token"},
        {"generation_config": "/srv/xhpc"},
        {"speculative_config": {"method": "draft_model", "model": "/srv/xhpc"}},
        {"speculative_config": {"model": "../../x"}},
        {"max_model_len": 0},
        {"speculative_config": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}},
        {"speculative_config": {"bad key": 1}},
        {"limit_mm_per_prompt": {"image": -1}},
        {"unknown_field": 1},
    ],
)
def test_hostile_or_malformed_values_are_refused_by_type(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelEngineConfig.model_validate(fields)


def test_the_engine_s_schema_says_which_flags_and_values_it_takes() -> None:
    assert schema_problems(TOOLS.argv("/w"), SCHEMA) == []
    bad = ModelEngineConfig(tool_call_parser="nosuch", kv_cache_dtype="fp3", quantization="awq")
    found = schema_problems(bad.argv("/w"), SCHEMA)
    assert any("--tool-call-parser nosuch" in p and "hermes" in p for p in found), found
    assert any(p.startswith("--kv-cache-dtype fp3: vllm 0.32.0 takes one of") for p in found)
    assert not any("awq" in p for p in found)  # a method vLLM checks itself, later
    assert schema_problems(["--no-such-flag", "1"], SCHEMA)[0].endswith("has no such option")
    assert schema_problems(["--enable-auto-tool-choice=1"], SCHEMA) == [
        "--enable-auto-tool-choice takes no value"
    ]
    assert "not JSON" in schema_problems(["--speculative-config", "{oops"], SCHEMA)[0]
    assert schema_problems(["--max-model-len"], SCHEMA) == ["--max-model-len needs a value"]


def test_admission_refuses_another_engine_an_inconsistent_config_and_what_the_engine_refuses() -> (
    None
):
    req = ServeRequest(model="/w/tiny", engine_config=ModelEngineConfig(tool_call_parser="nosuch"))
    assert engine_config_problems(req.engine_config, EngineKind.TRANSFORMERS, "/w", SCHEMA) == [
        "engine_config applies to the vllm engine, not transformers"
    ]
    found = engine_config_problems(req.engine_config, EngineKind.VLLM, "/w", SCHEMA)
    assert found and found[0].startswith("engine_config: --tool-call-parser nosuch"), found
    assert (
        engine_config_problems(req.engine_config, EngineKind.VLLM, "/w", None) == []
    )  # schema unknown: types only
    auto = req.model_copy(update={"engine_config": ModelEngineConfig(enable_auto_tool_choice=True)})
    assert engine_config_problems(auto.engine_config, EngineKind.VLLM, "/w", None) == [
        "engine_config: enable_auto_tool_choice needs a tool_call_parser"
    ]


def test_a_catalog_entry_s_config_reaches_the_request_and_the_agent_s_argv(
    tmp_path: Path, model_dir: Path
) -> None:
    config = XhpcConfig(
        state_dir=tmp_path / "state",
        models_dir=tmp_path / "models",
        models={"tiny": ModelEntry(path=model_dir, engine_config=TOOLS)},
    )
    req, _ = expand_request(ServeRequest(model="tiny"), config, {}, gpus_given=False)
    assert req.engine_config == TOOLS
    own = ModelEngineConfig(reasoning_parser="deepseek_r1")
    mine, _ = expand_request(
        ServeRequest(model="tiny", engine_config=own), config, {}, gpus_given=False
    )
    assert mine.engine_config == own  # the request's own wins over the entry's
    plan = plan_deployment(
        req.model_copy(update={"engine_args": ("--seed", "1")}),
        resolve_model("tiny", config),
        config,
        start_index=0,
        agent_python="/py",
    )
    (replica,) = plan.replicas
    args = replica.spec.args
    assert args[: len(TOOLS.argv(str(model_dir)))] == TOOLS.argv(str(model_dir))
    assert args[-2:] == ("--seed", "1")  # the request's own arguments come last
    assert f"{model_dir}/tool_chat_template.jinja" in args


def test_lora_slots_are_the_engine_s_flags_checked_by_its_schema_and_its_runtime_switch(
    tmp_path: Path, model_dir: Path
) -> None:
    cfg = ModelEngineConfig(lora={"max_loras": 2, "max_lora_rank": 8})
    assert cfg.argv("/w") == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    assert schema_problems(cfg.argv("/w"), SCHEMA) == []
    odd = ModelEngineConfig(lora={"max_lora_rank": 12})  # not one of vLLM's ranks
    (found,) = schema_problems(odd.argv("/w"), SCHEMA)
    assert found.startswith("--max-lora-rank 12: vllm 0.32.0 takes one of"), found
    for bad in ({"max_loras": 0}, {"max_lora_rank": 1024}, {"max_loras": 2, "path": "/x"}):
        with pytest.raises(ValidationError):
            ModelEngineConfig.model_validate({"lora": bad})
    assert ModelEngineConfig().env() == {}
    # The engine of a model with adapter slots may load adapters while it runs (vLLM's switch).
    config = XhpcConfig(
        state_dir=tmp_path / "state",
        models_dir=tmp_path / "models",
        models={"tiny": ModelEntry(path=model_dir, engine="vllm", engine_config=cfg)},
    )
    req, _ = expand_request(ServeRequest(model="tiny"), config, {}, gpus_given=False)
    plan = plan_deployment(
        req, resolve_model("tiny", config), config, start_index=0, agent_python="/py"
    )
    (replica,) = plan.replicas
    assert replica.spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in replica.spec.args


def test_a_chat_template_must_be_in_the_weights(model_dir: Path) -> None:
    cfg = ModelEngineConfig(chat_template="tools.jinja")
    found = engine_config_problems(cfg, EngineKind.VLLM, str(model_dir), None)
    assert found == [f"engine_config: no chat template 'tools.jinja' in {model_dir}"]
    (model_dir / "tools.jinja").write_text("{{ messages }}")
    assert engine_config_problems(cfg, EngineKind.VLLM, str(model_dir), None) == []
