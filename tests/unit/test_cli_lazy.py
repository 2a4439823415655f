"""The CLI loads a command's module only when that command runs; `xhpc --help` lists every
command from the table, each line the start of the command's own help."""

from __future__ import annotations

import subprocess
import sys

import click

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
    assert "'xhpc.cli.commands'" in loaded and "'xhpc.cli.serve'" not in loaded, loaded
