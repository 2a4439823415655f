"""The CLI loads a command's module only when that command runs; `xhpc --help` lists every
command from the table, each line the start of the command's own help; `xhpc ps` imports none of
the heavy packages (docs/performance.md, "CLI start")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from tests.unit.test_cli_client import serving
from xhpc.cli.main import COMMANDS, cli, load_command


def test_every_command_in_the_table_is_what_its_module_defines() -> None:
    for name, (_, summary) in COMMANDS.items():
        command = load_command(name)
        assert isinstance(command, click.Command) and command.name == name
        own = " ".join((command.help or "").split())
        assert own.startswith(summary.rstrip(".")), (name, summary, own[:120])
    assert set(cli.list_commands(click.Context(cli))) == set(COMMANDS)


def test_help_imports_no_command_module_and_ps_only_its_own() -> None:
    probe = (
        "import sys; sys.argv = ['xhpc'] + sys.argv[1:]\n"
        "from xhpc.cli.main import main\n"
        "try: main()\n"
        "except SystemExit: pass\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('xhpc.cli.') or m == 'pydantic')\n"
        "print(loaded, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "--help"], capture_output=True, text=True, check=True
    )
    assert "Commands:" in done.stdout and "serve" in done.stdout
    loaded = done.stderr.strip().splitlines()[-1]
    assert loaded == "['xhpc.cli.main', 'xhpc.cli.meta']", loaded
    done = subprocess.run(
        [sys.executable, "-c", probe, "config", "show", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    loaded = done.stderr.strip().splitlines()[-1]
    assert "'xhpc.cli.commands'" in loaded and "'xhpc.cli.deploy.serve'" not in loaded, loaded


# Not on `xhpc ps`'s path: the pydantic settings and models (most of what it took), the
# orchestration packages' dependencies, http.client (ssl, email).
HEAVY = (
    "pydantic", "pydantic_core", "xhpc.settings", "xhpc.models", "aiohttp", "sqlalchemy",
    "sqlmodel", "numpy", "jinja2", "msgspec", "http.client", "ssl",
)  # fmt: skip


def test_ps_imports_its_own_module_and_nothing_heavy(tmp_path: Path) -> None:
    probe = (
        "import sys; sys.argv = ['xhpc', 'ps'] + sys.argv[1:]\n"
        "from xhpc.cli.main import main\n"
        "try: main()\n"
        "except SystemExit as e: print('exit', e.code, file=sys.stderr)\n"
        f"print(sorted(m for m in {HEAVY!r} + ('xhpc.cli.observe.ps', 'xhpc.cli.commands')"
        " if m in sys.modules), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_STATE_DIR=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    replica = {
        "replica_id": "m-0", "deployment": "m", "role": None, "unit": None, "state": "READY",
        "engine": "vllm", "job_id": "1", "node": "n1", "gpus": [0], "host": "h", "port": 1,
        "reason": None,
    }  # fmt: skip
    deployment = {
        "name": "m", "replicas": [replica], "failed_reason": None, "stopped": False,
        "wanted": 2, "restart": "always",
    }  # fmt: skip
    answers = {
        "/v1/replicas?all=0": (200, json.dumps([replica]).encode()),
        "/v1/deployments": (200, json.dumps([deployment]).encode()),
        "/v1/pilots": (200, b"[]"),
    }
    for args in ([], ["--json"], ["--pilots"]):
        with serving(tmp_path / "state", answers):
            done = subprocess.run(
                [sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True,
                check=True,
            )  # fmt: skip
        *_, code, loaded = done.stderr.strip().splitlines()
        assert code == "exit 0", done.stderr
        assert "m-0" in done.stdout or args == ["--pilots"], done.stdout
        assert loaded == "['xhpc.cli.observe.ps']", (args, loaded)
