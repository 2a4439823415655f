"""A LoRA adapter's directory, checked before any engine loads it (foundation).

An adapter is a directory as PEFT writes it: ``adapter_config.json`` and the weights. An engine
loads it at runtime from a path it is given (vLLM's ``/v1/load_lora_adapter``), with the
permissions of the base model's job: so what it reads is checked first, by the one function
every door uses (``adapter_problems``):

- the directory and its two files are plain files of their own (no symlink: a link would let
  the engine read what its owner may read, not what the adapter's owner may);
- the weights are ``adapter_model.safetensors``: a PEFT ``.bin`` is a pickle, which runs code
  when it is loaded, and is refused;
- ``adapter_config.json`` is a small JSON object for a LoRA (``peft_type``), whose rank ``r``
  is within what the base's engine was started for (``max_rank``: vLLM's ``--max-lora-rank``)
  and whose target modules are plain module names (or ``all-linear``).
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
MAX_CONFIG_BYTES = 64 * 1024
MAX_RANK = 512  # vLLM's largest --max-lora-rank
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")


def _plain_file(path: Path) -> str | None:
    """Why ``path`` is not a plain file of its own (None: it is)."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return f"{path.name} is missing"
    if stat.S_ISLNK(mode):
        return f"{path.name} is a symbolic link"
    if not stat.S_ISREG(mode):
        return f"{path.name} is not a regular file"
    return None


def _config_problems(config: Any, max_rank: int) -> list[str]:
    if not isinstance(config, dict):
        return [f"{CONFIG_FILE} is not a JSON object"]
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"{CONFIG_FILE}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank = config.get("r")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        problems.append(
            f"{CONFIG_FILE}: r (the rank) must be an integer 1..{max_rank}, not {rank!r}"
        )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets == "all-linear" or _MODULE.fullmatch(targets) else None
    if (
        not isinstance(targets, list)
        or not targets
        or not all(
            isinstance(t, str) and (_MODULE.fullmatch(t) or t == "all-linear") for t in targets
        )
    ):
        problems.append(f"{CONFIG_FILE}: target_modules must be plain module names")
    return problems


def adapter_problems(directory: Path, max_rank: int = MAX_RANK) -> list[str]:
    """Why an engine must not load the adapter in ``directory`` (empty: it may)."""
    try:
        mode = directory.lstat().st_mode
    except OSError:
        return [f"adapter directory {directory} does not exist"]
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        return [f"adapter path {directory} is not a directory (a link to one is not taken)"]
    if (directory / PICKLED_WEIGHTS).exists() and not (directory / WEIGHTS_FILE).exists():
        return [f"{PICKLED_WEIGHTS} is a pickle, which runs code when loaded: save the adapter "
                f"as {WEIGHTS_FILE} (PEFT's save_pretrained(safe_serialization=True))"]  # fmt: skip
    problems = [
        p for p in map(_plain_file, (directory / CONFIG_FILE, directory / WEIGHTS_FILE)) if p
    ]
    if problems:
        return problems
    config_path = directory / CONFIG_FILE
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        return [f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES // 1024} KiB"]
    try:
        config = json.loads(config_path.read_bytes())
    except (OSError, ValueError) as err:
        return [f"{CONFIG_FILE} is not readable JSON: {err}"]
    return _config_problems(config, max_rank)
