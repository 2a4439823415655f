"""A model's typed engine configuration (pure): what a catalog entry (`[models.NAME.engine_config]`,
the site's or a member's) or a request says about how the engine serves that one model, beyond
the one-word `--engine-arg`s: tool calling, reasoning, the chat template, the generation config,
the context length, quantization, the KV cache's dtype, speculative decoding, structured
outputs (guided decoding: its backend) and per-prompt multimodal limits.

Each field becomes argv elements of vLLM's command line (:meth:`ModelEngineConfig.argv`), never
a shell word; values that are JSON objects go as one element each. Whether the installed engine
knows a flag and accepts a value is the engine's own schema's to say
(``xhpc.engine_schema``), not a list kept here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticValidationError

from xhpc.errors import first_problem, json_object

# A parser's, a quantization method's, a dtype's or a backend's name: one plain word.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
# A JSON value's size on the command line, at most.
MAX_JSON_CHARS = 4096
_JSON_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _scalar_or_nested(value: Any, depth: int = 0) -> bool:
    """JSON made of objects with plain keys, lists, strings, numbers, booleans and null."""
    if depth > 4:
        return False
    if isinstance(value, dict):
        return all(
            isinstance(k, str) and _JSON_KEY.fullmatch(k) and _scalar_or_nested(v, depth + 1)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return all(_scalar_or_nested(v, depth + 1) for v in value)
    if isinstance(value, str):  # no path out of the engine's own (empty, private) directory
        path = PurePosixPath(value)
        plain = not any(ord(c) < 32 for c in value) and len(value) <= 1024
        return plain and not path.is_absolute() and ".." not in path.parts
    return value is None or isinstance(value, (bool, int, float))


# vLLM reads this from the environment: without it, adapters load at start only (`--lora-modules`).
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class LoraSlots(BaseModel):
    """Room for LoRA adapters on a model's engine (`[models.NAME.engine_config.lora]`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_loras: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Adapters in one batch at once (`--max-loras`); more may be loaded.",
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        le=512,
        description="The largest rank of an adapter it takes (`--max-lora-rank`: one of the "
        "engine's own choices, e.g. 8, 16, 32, 64).",
    )


class ModelEngineConfig(BaseModel):
    """How the engine serves one model (vLLM). Unset fields leave the engine's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_call_parser: str | None = Field(
        default=None,
        description="The engine's tool-call parser for this model's output (e.g. `hermes`, "
        "`llama3_json`): the OpenAI `tools=` field then works (`--tool-call-parser`).",
    )
    enable_auto_tool_choice: bool = Field(
        default=False,
        description='`tool_choice="auto"`: the model decides, the parser reads its calls '
        "(`--enable-auto-tool-choice`; needs `tool_call_parser`).",
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="The parser that splits the model's reasoning from its answer "
        "(`--reasoning-parser`, e.g. `deepseek_r1`).",
    )
    chat_template: str | None = Field(
        default=None,
        description="A Jinja chat template file inside the weights' directory, by its relative "
        "name (`--chat-template`).",
    )
    generation_config: Literal["auto", "vllm"] | None = Field(
        default=None,
        description='Where sampling defaults come from: `"auto"` (the weights\' '
        '`generation_config.json`) or `"vllm"` (the engine\'s) (`--generation-config`).',
    )
    max_model_len: int | None = Field(
        default=None, ge=16, le=16_777_216, description="The context length (`--max-model-len`)."
    )
    quantization: str | None = Field(
        default=None, description="The quantization method (`--quantization`, e.g. `awq`, `fp8`)."
    )
    kv_cache_dtype: str | None = Field(
        default=None, description="The KV cache's dtype (`--kv-cache-dtype`, e.g. `fp8`)."
    )
    speculative_config: dict[str, Any] | None = Field(
        default=None,
        description="Speculative decoding, as the engine's JSON object "
        '(`--speculative-config`, e.g. `{method = "ngram", num_speculative_tokens = 4, '
        "prompt_lookup_max = 4}`).",
    )
    structured_outputs: dict[str, Any] | None = Field(
        default=None,
        description="Guided decoding (`response_format`, named and required tool choices), as "
        'the engine\'s JSON object (`--structured-outputs-config`, e.g. `{backend = "xgrammar", '
        "disable_any_whitespace = true}`).",
    )
    limit_mm_per_prompt: dict[str, int] | None = Field(
        default=None,
        description="Per-prompt limits of multimodal inputs (`--limit-mm-per-prompt`, e.g. "
        "`{image = 2, video = 0}`).",
    )
    lora: LoraSlots | None = Field(
        default=None,
        description="LoRA adapters served on this model, loaded while it runs (`--enable-lora` "
        "with `max_loras` and `max_lora_rank`, e.g. `{max_loras = 4, max_lora_rank = 16}`).",
    )

    @field_validator(
        "tool_call_parser",
        "reasoning_parser",
        "quantization",
        "kv_cache_dtype",
    )
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not NAME_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not a plain name (letters, digits, _ . + -)")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        # Inside the weights alone: a job of a lab broker runs as its service user, and a
        # template's text goes into every prompt (an absolute path would show that user's
        # files to whoever asks).
        if value is None:
            return None
        path = PurePosixPath(value)
        bad = not value or any(ord(c) < 32 for c in value) or len(value) > 255
        if bad or value.startswith("-") or path.is_absolute() or ".." in path.parts:
            raise ValueError(
                f"{value!r}: a file name inside the weights' directory (no '/…', '..')"
            )
        return value

    @field_validator("speculative_config", "structured_outputs")
    @classmethod
    def _json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if not _scalar_or_nested(value):
            raise ValueError(
                "a JSON object of plain keys and values (no absolute paths, no '..'), at most "
                "4 levels deep"
            )
        if len(json.dumps(value)) > MAX_JSON_CHARS:
            raise ValueError(f"longer than {MAX_JSON_CHARS} characters as JSON")
        return value

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _limits(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for key, limit in (value or {}).items():
            if not _JSON_KEY.fullmatch(key) or not 0 <= limit <= 1024:
                raise ValueError(f"{key} = {limit}: a modality name and 0..1024")
        return value

    def argv(self, weights_dir: str) -> tuple[str, ...]:
        """The engine's command-line elements for these settings (``weights_dir``: where the
        chat template is)."""
        out: list[str] = []
        if self.tool_call_parser:
            out += ["--tool-call-parser", self.tool_call_parser]
        if self.enable_auto_tool_choice:
            out.append("--enable-auto-tool-choice")
        if self.reasoning_parser:
            out += ["--reasoning-parser", self.reasoning_parser]
        if self.chat_template:
            out += ["--chat-template", str(PurePosixPath(weights_dir) / self.chat_template)]
        if self.generation_config:
            out += ["--generation-config", self.generation_config]
        if self.max_model_len is not None:
            out += ["--max-model-len", str(self.max_model_len)]
        if self.quantization:
            out += ["--quantization", self.quantization]
        if self.kv_cache_dtype:
            out += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.speculative_config is not None:
            out += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.structured_outputs is not None:
            guided = json.dumps(self.structured_outputs, sort_keys=True)
            out += ["--structured-outputs-config", guided]
        if self.limit_mm_per_prompt is not None:
            limits = json.dumps(self.limit_mm_per_prompt, sort_keys=True)
            out += ["--limit-mm-per-prompt", limits]
        if self.lora is not None:
            out += ["--enable-lora", "--max-loras", str(self.lora.max_loras)]
            out += ["--max-lora-rank", str(self.lora.max_lora_rank)]
        return tuple(out)

    def env(self) -> dict[str, str]:
        """The engine's environment for these settings (adapters loaded while it runs)."""
        return dict(RUNTIME_LORA_ENV) if self.lora is not None else {}

    def problems(self) -> list[str]:
        """What is inconsistent within the settings themselves."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            return ["engine_config: enable_auto_tool_choice needs a tool_call_parser"]
        return []


def engine_config_of(value: str | Mapping[str, Any], what: str) -> ModelEngineConfig:
    """A typed engine configuration from a JSON object's text (a command line's) or a mapping
    (the Python API's); ``what`` names it in the one-line error (``--engine-config``)."""
    raw = json_object(value, what) if isinstance(value, str) else dict(value)
    try:
        return ModelEngineConfig.model_validate(raw)
    except PydanticValidationError as err:
        raise first_problem(err, what) from err
