"""Admission of what a user types: `--engine-arg` allow-lists and the `--replica-config` syntax,
and the two options through the CLI (no broker, no Slurm)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xhpc.broker.admit.admission import (
    DEFAULT_ENGINE_ARGS,
    admission_problems,
    engine_arg_problems,
    replica_targets,
)
from xhpc.cli.deploy.replica_configs import parse_replica_config
from xhpc.cli.main import main
from xhpc.config import XhpcConfig
from xhpc.errors import ValidationError
from xhpc.models import EngineKind, NodeInfo, ReplicaConfig, ServeRequest

VLLM, TRANSFORMERS, COMMAND = EngineKind.VLLM, EngineKind.TRANSFORMERS, EngineKind.COMMAND
RC = ReplicaConfig


# -- engine arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("engine", "args"),
    [
        (VLLM, ["--max-model-len", "512", "--dtype=float16", "--enforce-eager"]),
        (VLLM, ["--max_model_len", "512", "-tp", "1", "--seed", "-1", "--swap-space", "-1.5e3"]),
        (VLLM, ["--kv-cache-memory-bytes", "67108864", "--gpu-memory-utilization", "0.5"]),
        (TRANSFORMERS, ["--continuous-batching", "--attn-implementation", "sdpa"]),
        (TRANSFORMERS, ["--no-continuous-batching", "--dtype", "float32"]),
        (COMMAND, ["--port", "1", "--anything", "goes"]),
    ],
)
def test_allowed_engine_args(engine: EngineKind, args: list[str]) -> None:
    assert engine_arg_problems(engine, args) == []


@pytest.mark.parametrize(
    ("engine", "args", "named"),
    [
        (VLLM, ["--port", "9000"], "--port (xhpc sets it)"),
        (VLLM, ["--port=9000"], "--port (xhpc sets it)"),
        (VLLM, ["--served-model-name", "x"], "--served-model-name (xhpc sets it)"),
        (VLLM, ["--served_model_name", "x"], "--served_model_name (xhpc sets it)"),
        (VLLM, ["--host", "0.0.0.0", "--api-key", "k"], "--host (xhpc sets it), --api-key"),
        (VLLM, ["--trust-remote-code"], "--trust-remote-code"),
        (VLLM, ["--enforce-eager", "--model", "/etc"], "--model (xhpc sets it)"),
        (VLLM, ["--max-model"], "--max-model"),  # argparse would expand the prefix: refused
        (TRANSFORMERS, ["--port", "1"], "--port (xhpc sets it)"),
        (TRANSFORMERS, ["--trust-remote-code"], "--trust-remote-code"),
    ],
)
def test_refused_engine_args_name_the_flag_and_the_allowed_ones(
    engine: EngineKind, args: list[str], named: str
) -> None:
    (found,) = engine_arg_problems(engine, args)
    assert found.startswith(f"engine argument(s) not allowed for {engine.value}: {named}")
    allowed = DEFAULT_ENGINE_ARGS[engine]
    assert allowed is not None
    assert found.endswith("; allowed: " + " ".join(sorted(allowed)))


@pytest.mark.parametrize("engine", list(EngineKind))
@pytest.mark.parametrize("arg", ["a\nb", "x\x00", "\x1b[2J", "tab\there"])
def test_control_characters_are_refused_for_every_engine(engine: EngineKind, arg: str) -> None:
    (found,) = engine_arg_problems(engine, ["--dtype", arg])
    assert found == f"engine argument(s) {arg!r} contain control characters"


@pytest.mark.parametrize("engine", list(EngineKind))
@pytest.mark.parametrize(
    "arg", ["; rm -rf /", "$(id)", "`id`", "a b", "x|y", "a&b", "'q'", '{"a": 1}', "x>y", "x" * 257]
)
def test_shell_metacharacters_and_blanks_are_refused_for_every_engine(
    engine: EngineKind, arg: str
) -> None:
    (found,) = engine_arg_problems(engine, ["--dtype", arg])
    assert found == (
        f"engine argument(s) {arg!r} are not allowed: each must be one word of letters, digits "
        "and . _ - + = : , / @ % (at most 256; options with other values belong in the site "
        "config's [engines.NAME] args)"
    )


def test_a_flag_with_a_hostile_value_is_refused_once() -> None:
    """`--dtype=a;b`: refused for its characters, not also as an unknown flag."""
    (found,) = engine_arg_problems(VLLM, ["--dtype=a;b"])
    assert found.startswith("engine argument(s) '--dtype=a;b' are not allowed: each must be")


def test_engine_args_are_checked_by_admission(idle_nodes: list[NodeInfo]) -> None:
    request = ServeRequest(model="m", engine_args=("--port", "1"))
    (found,) = admission_problems(request, idle_nodes, XhpcConfig(), TRANSFORMERS)
    assert found.startswith("engine argument(s) not allowed for transformers: --port")
    site = {VLLM: frozenset({"--port"})}  # a site may allow more (or less)
    assert (
        admission_problems(request, idle_nodes, XhpcConfig(), VLLM, engine_args_allowed=site) == []
    )


# -- targets and the --replica-config syntax -------------------------------------------------------
def test_replica_targets_fill_in_the_request() -> None:
    request = ServeRequest(
        model="m", replicas=3, gpus=2, gpu_type="a100", replica_configs=(RC(node="n1", gpus=1),)
    )
    assert replica_targets(request) == [
        RC(node="n1", gpus=1, gpu_type="a100"),
        RC(gpus=2, gpu_type="a100"),
        RC(gpus=2, gpu_type="a100"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node=n1", RC(node="n1")),
        ("node=n1,gpus=2,gpu_idx=0+1", RC(node="n1", gpus=2, gpu_idx=(0, 1))),
        (" gpu_type = a100 , gpus=1 ", RC(gpus=1, gpu_type="a100")),
        ("", RC()),
        ('{"node": "n2", "gpu_idx": [3]}', RC(node="n2", gpu_idx=(3,))),
    ],
)
def test_parse_replica_config(text: str, expected: ReplicaConfig) -> None:
    assert parse_replica_config(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("node", "'node' is not KEY=VALUE"),
        ("node=n1,node=n2", "node given twice"),
        ("host=n1", "unknown key(s) host (valid: node, gpus, gpu_type, gpu_idx)"),
        ("gpus=two", "gpus: Input should be a valid integer"),
        ("gpus=0", "gpus: Input should be greater than or equal to 1"),
        ("gpu_idx=0+x", "gpu_idx.1: Input should be a valid integer"),
        ("gpu_idx=-1", "GPU indexes must be 0..1023"),
        ("node=n1;id", "invalid node or GPU type"),
        ("node=a\nb", "invalid node or GPU type"),
        ("{bad json", "not valid JSON"),
        ("[1]", "'[1]' is not KEY=VALUE"),
        ('{"gpus": 1, "x": 2}', "unknown key(s) x"),
    ],
)
def test_parse_replica_config_errors(text: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_replica_config(text)
    assert info.value.message.startswith(f"--replica-config {text!r}: ")
    assert needle in info.value.message


# -- through the CLI (in-process; no broker, no Slurm) ---------------------------------------------
def serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["xhpc", "serve", *args])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    (line,) = err.splitlines()
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--replica-config", "host=n1"], "--replica-config 'host=n1': unknown key(s) host"),
        (["--replica-config", "node=n1", "--replica-config", "gpus=x"], "gpus: Input should be"),
        (["--gpu-type", "a100;rm"], "--gpu-type: invalid GPU type"),
    ],
)
def test_cli_refuses_bad_options_before_any_broker_call(
    clean_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
) -> None:
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    line = serve(monkeypatch, capsys, str(model), *args)
    assert needle in line
