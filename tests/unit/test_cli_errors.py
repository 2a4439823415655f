"""The CLI's error contract with no broker and no Slurm: exit codes and one-line `error:` messages.

Most cases call `xhpc.cli.main.main` in-process (it maps XhpcError to exit codes, as the console
script does); one test runs the installed console script to prove the entry point itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import Run, one_error_line

XHPC = str(Path(sys.executable).parent / "xhpc")


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
    assert f"no socket at {clean_env / 'broker.sock'}, in state directory {clean_env})" in line
    assert result.out == ""


def test_no_broker_and_no_site_config_says_where_it_looked_and_how_to_give_one(
    xhpc: Run, clean_env: Path
) -> None:
    """The usual slip: the broker runs with a site config, this shell has none. The hint says
    so and how to give one, and does not invite a second broker."""
    for args in (["ps"], ["stop", "m"], ["scale", "m", "2"]):
        line = one_error_line(xhpc(*args))
        assert f"in state directory {clean_env}" in line
        assert "no site config was given" in line
        assert "--site FILE or export XHPC_SITE_CONFIG=FILE" in line
        assert "`xhpc broker`" not in line


def test_no_broker_with_a_site_config_says_to_start_it(
    xhpc: Run, clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site.toml"
    site.write_text("")
    monkeypatch.setenv("XHPC_SITE_CONFIG", str(site))
    line = one_error_line(xhpc("ps"))
    assert "no site config" not in line
    assert "(hint: start it with `xhpc broker` and the same config)" in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["scale", "m", "-1"], "-1: negative numbers are not allowed here"),
        (["scale", "m"], "missing argument 'REPLICAS'"),
        (["scale", "m", "two"], "invalid value for '[REPLICAS]': 'two' is not a valid integer"),
        (["serve"], "missing argument 'MODEL'"),
        (["serve", "m", "--engine", "nope"], "invalid value for '--engine': 'nope' is not one of"),
        (["ps", "--bogus"], "no such option '--bogus'"),
        (["keys", "create", "--rpm", "x"], "invalid value for '--rpm'"),
    ],
)
def test_usage_errors_are_one_error_line_with_a_hint_to_help(
    xhpc: Run, args: list[str], said: str
) -> None:
    result = xhpc(*args)
    assert result.code == 2
    line = one_error_line(result)
    assert line.startswith(f"error: {said}"), line
    command = " ".join(a for a in args[:2] if a.isalpha() and a != "m")
    assert line.endswith(f"(hint: see `xhpc {command} --help`)"), line
    assert "Usage:" not in result.err and result.out == ""


def test_pydantic_wording_is_not_shown(xhpc: Run, local_model: Path) -> None:
    line = one_error_line(xhpc("serve", str(local_model), "--gpu-type", "a;b"))
    assert line.startswith("error: --gpu-type: invalid GPU type a;b: use 1-63 letters")
    assert "Value error" not in line


def test_a_bad_name_says_what_names_may_be(xhpc: Run, local_model: Path) -> None:
    line = one_error_line(xhpc("serve", str(local_model), "--name", "my model"))
    assert line == (
        "error: --name: invalid deployment name my model: use 1-63 letters, digits, '.', '_' "
        "or '-', starting with a letter or digit"
    )


@pytest.mark.parametrize(
    ("args", "code", "kind"),
    [
        (["ps", "--json"], ("broker_unavailable", "service_unavailable"), 4),
        (["serve", "a;b", "--json"], ("invalid_request", "invalid_request_error"), 2),
        (["serve", "no-such-model", "--json"], ("not_found", "not_found_error"), 3),
        (["scale", "m", "-1", "--json"], ("usage_error", "invalid_request_error"), 2),
    ],
)
def test_json_errors_are_an_error_object_on_stdout(
    xhpc: Run, args: list[str], code: tuple[str, str], kind: int
) -> None:
    result = xhpc(*args)
    assert result.code == kind  # the exit code of the error, as without --json
    line = one_error_line(result)
    body = json.loads(result.out)
    assert body == {
        "error": {
            "message": line.removeprefix("error: "),
            "type": code[1],
            "param": "-1" if args[0] == "scale" else None,
            "code": code[0],
        }
    }


def test_unknown_env_var_is_a_config_error(xhpc: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XHPC_PORT", "1")
    result = xhpc("ps")
    assert result.code == 2
    assert "XHPC_PORT" in one_error_line(result)


def test_console_script(tmp_path: Path) -> None:
    """The installed `xhpc` script: same contract, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_STATE_DIR=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    cases = [
        (["serve", "evil'\n; rm -rf /"], 2),
        (["serve", "nope"], 3),
        (["ps"], 4),
        (["scale", "m", "-1"], 2),
        (["ps", "--json"], 4),
    ]
    for args, code in cases:
        proc = subprocess.run([XHPC, *args], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == code, (args, proc.stderr)
        if "--json" in args:
            assert json.loads(proc.stdout)["error"]["code"] == "broker_unavailable"
        else:
            assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("error: ")
