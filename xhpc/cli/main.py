"""`xhpc` — the command-line entry point."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from xhpc import __version__
from xhpc.cli.meta import ARGS_META, DEBUG_META, REMOTE_META, SITE_META, config_check_invoked
from xhpc.errors import BrokerUnavailableError, ConfigError, XhpcError
from xhpc.remote.argv import LOCAL_COMMANDS, RemoteOptions, RemoteSplit, split_remote

# Each command: its module under xhpc.cli (by responsibility: deploy, observe, admin; the
# daemons and the core here), and the line `xhpc --help` shows for it (the start of
# the command's own help: tests/unit/test_cli_lazy.py checks it). A command's module is imported
# only when that command runs: `xhpc --help` imports none of them, `xhpc ps` only its own.
COMMANDS: dict[str, tuple[str, str]] = {
    "adapters": (
        "deploy.adapters",
        "LoRA adapters on your deployments: each served by its own name on",
    ),
    "batch": (
        "deploy.batch",
        "Batch inference: a JSONL file of requests run as a Slurm job array.",
    ),
    "broker": ("daemons", "Run the broker (control API, agent API, reconcile loop)."),
    "cache": (
        "admin.cache",
        "The weights cache: the shared store's models and nodes' local copies.",
    ),
    "config": ("commands", "Inspect the configuration."),
    "doctor": ("observe.doctor", "Check the serving plane."),
    "keys": ("admin.keys", "API keys for the OpenAI gateway (admins only)."),
    "logs": ("commands", "Show a replica's job output and engine log."),
    "models": ("admin.models", "The model catalog: the site's (read-only) and your own (add, rm)."),
    "nodes": (
        "observe.nodes",
        "Show nodes and GPUs: Slurm's allocation, the probes' view, open reservations.",
    ),
    "probe": ("daemons", "Sample this node's GPUs (NVML or fake), CPU and memory."),
    "proxy": ("daemons", "Run the OpenAI-compatible proxy in the foreground."),
    "ps": ("observe.ps", "List replicas and their states (or, with --pilots, the pilot jobs)."),
    "run-server": ("local", "Serve MODEL on this job's GPUs and this node, until the job ends."),
    "scale": ("deploy.scale", "Scale deployment NAME to REPLICAS replicas."),
    "serve": ("deploy.serve", "Serve MODEL (a catalog name or a local path) on the cluster."),
    "state": (
        "admin.state",
        "The broker's state: a consistent backup to one file, and its restore.",
    ),
    "stop": ("commands", "Stop a deployment (MODEL) or one REPLICA."),
    "top": ("observe.top", "Live dashboard: nodes, GPUs, replicas, proxy traffic, recent events."),
    "tunnel": (
        "remote",
        "Forward a local port to the lab's proxy over SSH (with --remote USER@HOST).",
    ),
    "usage": ("admin.keys", "Requests and tokens per key, user, account and model."),
}

# Commands that only ask the broker and print its answers: the group loads no config for them
# (validating it builds the pydantic settings, most of what `xhpc ps` took); they find the
# broker's socket from the config's state_dir alone (xhpc.cli.context.broker_of).
BROKER_ONLY = frozenset({"ps"})
# Commands that run here and use --remote's connection: no local config either.
NO_CONFIG = BROKER_ONLY | LOCAL_COMMANDS


def load_command(name: str) -> click.Command:
    module = importlib.import_module(f"xhpc.cli.{COMMANDS[name][0]}")
    command = getattr(module, name.replace("-", "_"))
    assert isinstance(command, click.Command)
    return command


class _Cli(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        ctx.meta[ARGS_META] = list(rest)  # after the subcommand's name
        return rest

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokerUnavailableError as err:
            from xhpc.cli.failures import explain_unavailable

            explain_unavailable(err, ctx.meta.get(SITE_META))
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name) if cmd_name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the table, importing no command's module."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="xhpc")
@click.option(
    "--site",
    "site",
    type=click.Path(path_type=Path),
    default=None,
    help="Site config file (default: $XHPC_SITE_CONFIG).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option(
    "--remote",
    metavar="[USER@]HOST[:PORT]",
    default=None,
    help="Run the command on this login node over SSH (same output and exit code; no local"
    " config needed).",
)
@click.option(
    "--identity",
    multiple=True,
    metavar="FILE",
    help="With --remote: a private key file (default: ssh-agent, then ~/.ssh/id_*).",
)
@click.option(
    "--remote-xhpc",
    metavar="COMMAND",
    default=None,
    help="With --remote: the xhpc to run there (default: $XHPC_REMOTE_XHPC, else xhpc on"
    " its PATH).",
)
@click.option(
    "--known-hosts",
    metavar="FILE",
    default=None,
    help="With --remote: the known_hosts file (default: ~/.ssh/known_hosts).",
)
@click.option(
    "--accept-new-host-key",
    is_flag=True,
    help="With --remote: add an unknown host key to known_hosts (a changed one is always refused).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    site: Path | None,
    debug: bool,
    remote: str | None,
    identity: tuple[str, ...],
    remote_xhpc: str | None,
    known_hosts: str | None,
    accept_new_host_key: bool,
) -> None:
    """xhpc: serve open LLMs on Slurm behind an OpenAI-compatible endpoint."""
    ctx.meta[SITE_META] = site
    ctx.meta[DEBUG_META] = debug
    if remote is not None:
        if ctx.invoked_subcommand not in LOCAL_COMMANDS:  # main() sent the others already
            raise click.UsageError("--remote goes before the command's name")
        ctx.meta[REMOTE_META] = RemoteOptions(
            remote, identity, remote_xhpc, known_hosts, accept_new_host_key
        )
    elif identity or remote_xhpc or known_hosts or accept_new_host_key:
        raise click.UsageError("--identity, --remote-xhpc, --known-hosts: only with --remote")
    if ctx.invoked_subcommand in NO_CONFIG:
        return  # no config to load, and nothing on their path logs
    # Imported here, not at the top: `xhpc --help` never runs this (the settings are pydantic).
    import logging

    from xhpc.cli.context import Ctx
    from xhpc.config import load_config
    from xhpc.settings import XhpcConfig

    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        config, sources = load_config(site)
    except ConfigError:
        if not config_check_invoked(ctx):
            raise
        config, sources = XhpcConfig(), []  # `config check` loads it again and lists problems
    ctx.obj = Ctx(config=config, sources=sources, debug=debug)


def _remote_split(argv: list[str]) -> RemoteSplit | None:
    """`--remote` among the group's options, for a command that runs on the login node."""
    takes_value = {
        name
        for param in cli.params
        if isinstance(param, click.Option) and not param.is_flag
        for name in param.opts
    }
    split = split_remote(argv, takes_value)
    return None if split is None or split.command in LOCAL_COMMANDS else split


def main() -> None:
    """The console script: every failure ends as one `error:` line (xhpc.cli.failures, imported
    only then: `xhpc --help` loads no more than this module and xhpc.cli.meta)."""
    debug = "--debug" in sys.argv
    try:
        split = _remote_split(sys.argv[1:])
        if split is not None:  # the rest of argv, as is, to the login node's xhpc
            from xhpc.cli.remote import run_remote

            sys.exit(run_remote(split, debug=debug))
        rv = cli.main(prog_name="xhpc", standalone_mode=False)  # hints name `xhpc`, however run
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        from xhpc.cli.failures import fail_usage, fail_xhpc, json_requested

        if isinstance(err, click.UsageError):
            fail_usage(err, json_requested(sys.argv[1:]))
        # not a usage error (a file click could not open)
        fail_xhpc(XhpcError(err.format_message()), json_requested(sys.argv[1:]))
    except XhpcError as err:
        from xhpc.cli.failures import fail_xhpc, json_requested

        if debug:
            import traceback

            traceback.print_exc()
        fail_xhpc(err, json_requested(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
