"""The installed engine's own argument schema (pure): read from the engine, never a list kept
here, and what it says of an engine configuration's command line.

``SCHEMA_SCRIPT`` runs with the engine's Python (``python -I -c SCRIPT``, through the runner)
and prints one JSON object: the engine's version, every option of its OpenAI server's argument
parser (its flags, how many values it takes, its choices) and the names of its registered tool-call
and reasoning parsers. :func:`schema_problems` checks argv elements against it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xhpc.engine_config import ModelEngineConfig
from xhpc.models import EngineKind

# Run by the engine's interpreter: vLLM's own parser for `vllm serve`, and its parser registries.
SCHEMA_SCRIPT = """
import json, sys
import vllm
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
parser = make_arg_parser(FlexibleArgumentParser())
options = {}
for action in parser._actions:
    for flag in action.option_strings:
        choices = None
        if action.choices is not None:
            choices = [str(c) for c in action.choices]
        kind = getattr(action.type, "__name__", "")
        options[flag] = {
            "values": 0 if action.nargs == 0 else (1 if action.nargs in (None, "?") else -1),
            "choices": choices,
            "json_value": kind in ("parse_dataclass", "_parse_type") or flag.endswith("-config"),
        }
try:
    from vllm.tool_parsers import ToolParserManager
    tools = ToolParserManager.list_registered()
except Exception:
    tools = []
try:
    from vllm.reasoning import ReasoningParserManager
    reasoning = ReasoningParserManager.list_registered()
except Exception:
    reasoning = []
json.dump({"engine": "vllm", "version": vllm.__version__, "options": options,
           "tool_parsers": tools, "reasoning_parsers": reasoning}, sys.stdout)
"""


class OptionSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    values: int  # 0: a switch; 1: one value; -1: one or more
    choices: tuple[str, ...] | None = None
    json_value: bool = False  # its value may be a JSON object


class EngineSchema(BaseModel):
    """What the installed engine accepts on its command line."""

    model_config = ConfigDict(frozen=True)

    engine: str
    version: str
    options: dict[str, OptionSpec]
    tool_parsers: tuple[str, ...] = ()
    reasoning_parsers: tuple[str, ...] = ()

    @classmethod
    def from_output(cls, text: str) -> EngineSchema:
        """The schema from ``SCHEMA_SCRIPT``'s output (ValueError when it is not one)."""
        lines = text.strip().splitlines()
        return cls.model_validate_json(lines[-1] if lines else "")


_PARSERS = {
    "--tool-call-parser": ("tool_parsers", "tool-call parser"),
    "--reasoning-parser": ("reasoning_parsers", "reasoning parser"),
}


def schema_problems(argv: Sequence[str], schema: EngineSchema) -> list[str]:
    """Why the engine would refuse ``argv`` (flags and their values), as its schema says:
    an unknown flag, a value outside its choices, a parser it has not registered, a JSON value
    that does not parse. ``--flag=value`` counts as ``--flag value``."""
    problems: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if not item.startswith("-"):
            problems.append(f"{item!r} is not a flag of {schema.engine} {schema.version}")
            continue
        flag, eq, inline = item.partition("=")
        spec = schema.options.get(flag)
        if spec is None:
            problems.append(f"{flag}: {schema.engine} {schema.version} has no such option")
            continue
        if spec.values == 0:
            if eq:
                problems.append(f"{flag} takes no value")
            continue
        if eq:
            value = inline
        elif i < len(items):
            value = items[i]
            i += 1
        else:
            problems.append(f"{flag} needs a value")
            continue
        problems += _value_problems(flag, value, spec, schema)
    return problems


def _value_problems(flag: str, value: str, spec: OptionSpec, schema: EngineSchema) -> list[str]:
    if spec.choices is not None and value not in spec.choices:
        shown = ", ".join(spec.choices[:12]) + (", …" if len(spec.choices) > 12 else "")
        return [f"{flag} {value}: {schema.engine} {schema.version} takes one of {shown}"]
    if flag in _PARSERS:
        field, what = _PARSERS[flag]
        known: tuple[str, ...] = getattr(schema, field)
        if known and value not in known:
            return [
                f"{flag} {value}: {schema.engine} {schema.version} has no {what} of that name "
                f"(it has: {', '.join(known)})"
            ]
    if spec.json_value and value.startswith("{"):
        try:
            json.loads(value)
        except ValueError as err:
            return [f"{flag}: its value is not JSON ({err})"]
    return []


def engine_config_problems(
    cfg: ModelEngineConfig | None, engine: EngineKind, weights: str, schema: EngineSchema | None
) -> list[str]:
    """A model's engine configuration, wherever it is about to be served (admission, and
    in-allocation serving): vLLM's alone; consistent in itself; its chat template in the
    weights' directory (``weights``, when it is one here); and (where the installed engine's
    schema is known) every flag and value one that engine accepts."""
    if cfg is None:
        return []
    if engine is not EngineKind.VLLM:
        return [f"engine_config applies to the vllm engine, not {engine.value}"]
    problems = cfg.problems()
    if (
        cfg.chat_template
        and Path(weights).is_dir()
        and not (Path(weights) / cfg.chat_template).is_file()
    ):
        problems.append(f"engine_config: no chat template {cfg.chat_template!r} in {weights}")
    if schema is not None:
        problems += [f"engine_config: {p}" for p in schema_problems(cfg.argv(weights), schema)]
    return problems
