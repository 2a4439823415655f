"""A LoRA adapter's directory is checked before any engine loads it (``xhpc.adapters``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from xhpc.adapters import adapter_problems

pytestmark = pytest.mark.adversarial

GOOD = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def adapter(
    tmp_path: Path, config: object = GOOD, weights: str = "adapter_model.safetensors"
) -> Path:
    d = tmp_path / "a1"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / weights).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return d


def test_a_peft_lora_directory_passes(tmp_path: Path) -> None:
    assert adapter_problems(adapter(tmp_path)) == []
    assert adapter_problems(adapter(tmp_path / "x", {**GOOD, "target_modules": "all-linear"})) == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "not 'LORA'"),
        ({"r": 0}, "r (the rank)"),
        ({"r": 16}, "r (the rank) must be an integer 1..8"),
        ({"r": "8"}, "r (the rank)"),
        ({"r": True}, "r (the rank)"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["q_proj; rm -rf /"]}, "target_modules"),
        ({"target_modules": "../../etc"}, "target_modules"),
        ({"target_modules": [1]}, "target_modules"),
    ],
)
def test_a_config_that_is_not_a_plain_lora_within_the_rank_is_refused(
    tmp_path: Path, change: dict[str, object], needle: str
) -> None:
    problems = adapter_problems(adapter(tmp_path, {**GOOD, **change}), max_rank=8)
    assert len(problems) == 1 and needle in problems[0], problems


def test_what_an_engine_must_not_read_is_refused(tmp_path: Path) -> None:
    assert "does not exist" in adapter_problems(tmp_path / "nope")[0]
    pickled = adapter(tmp_path / "p", weights="adapter_model.bin")
    assert "is a pickle" in adapter_problems(pickled)[0]
    linked = adapter(tmp_path / "l")
    (linked / "adapter_model.safetensors").unlink()
    os.symlink("/etc/hostname", linked / "adapter_model.safetensors")
    assert adapter_problems(linked) == ["adapter_model.safetensors is a symbolic link"]
    os.symlink(adapter(tmp_path / "t"), tmp_path / "link-to-dir")
    assert "not a directory" in adapter_problems(tmp_path / "link-to-dir")[0]
    not_json = adapter(tmp_path / "j")
    (not_json / "adapter_config.json").write_text("{oops")
    assert "not readable JSON" in adapter_problems(not_json)[0]
    (not_json / "adapter_config.json").write_text("[1]")
    assert adapter_problems(not_json) == ["adapter_config.json is not a JSON object"]
    (not_json / "adapter_config.json").write_text(" " * (65 * 1024))
    assert "larger than 64 KiB" in adapter_problems(not_json)[0]
