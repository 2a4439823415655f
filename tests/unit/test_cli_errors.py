"""The CLI's error contract with no broker and no Slurm: exit codes and one-line `error:` messages.

Most cases call `xhpc.cli.main.main` in-process (it maps XhpcError to exit codes, as the console
script does); one test runs the installed console script to prove the entry point itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import Result, Run

XHPC = str(Path(sys.executable).parent / "xhpc")


def one_error_line(result: Result) -> str:
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture
def local_model(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "m"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.mark.parametrize("model", ["bad'name", 'bad"name', "bad\nname", "a;b", "x/../y", "$(id)"])
def test_serve_hostile_model_name(xhpc: Run, model: str) -> None:
    result = xhpc("serve", model)
    assert result.code == 2
    line = one_error_line(result)
    assert "invalid model name" in line
    assert result.out == ""


@pytest.mark.parametrize("name", ["a'b", "a\nb", "a;b"])
def test_serve_hostile_deployment_name(xhpc: Run, local_model: Path, name: str) -> None:
    result = xhpc("serve", str(local_model), "--name", name)
    assert result.code == 2
    assert "--name" in one_error_line(result)


def test_serve_unknown_model(xhpc: Run) -> None:
    result = xhpc("serve", "no-such-model")
    assert result.code == 3
    line = one_error_line(result)
    assert "unknown model 'no-such-model'" in line
    assert "tiny-llama" in line  # the hint lists the catalog


def test_serve_zero_gpus(xhpc: Run, local_model: Path) -> None:
    result = xhpc("serve", str(local_model), "--gpus", "0")
    assert result.code == 2
    assert "--gpus must be at least 1" in one_error_line(result)


def test_serve_negative_gpus(xhpc: Run, local_model: Path) -> None:
    result = xhpc("serve", str(local_model), "--gpus", "-1")
    assert result.code == 2
    assert "--gpus" in one_error_line(result)


def test_serve_bad_time(xhpc: Run, local_model: Path) -> None:
    result = xhpc("serve", str(local_model), "--time", "1h; id")
    assert result.code == 2
    assert "--time" in one_error_line(result)


def test_serve_without_broker(xhpc: Run, local_model: Path) -> None:
    result = xhpc("serve", str(local_model))
    assert result.code == 4
    assert "broker is not running" in one_error_line(result)


def test_ps_without_broker(xhpc: Run, clean_env: Path) -> None:
    result = xhpc("ps")
    assert result.code == 4
    line = one_error_line(result)
    assert "broker is not running" in line
    assert str(clean_env / "broker.sock") in line
    assert result.out == ""


def test_unknown_env_var_is_a_config_error(xhpc: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XHPC_PORT", "1")
    result = xhpc("ps")
    assert result.code == 2
    assert "XHPC_PORT" in one_error_line(result)


def test_console_script(tmp_path: Path) -> None:
    """The installed `xhpc` script: same contract, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_STATE_DIR=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    cases = [(["serve", "evil'\n; rm -rf /"], 2), (["serve", "nope"], 3), (["ps"], 4)]
    for args, code in cases:
        proc = subprocess.run([XHPC, *args], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == code, (args, proc.stderr)
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("error: ")
