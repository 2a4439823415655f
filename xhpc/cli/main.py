"""`xhpc` — the command-line entry point."""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import click

from xhpc import __version__
from xhpc.cli import commands, config_check, daemons, doctor, keys, scale, serve
from xhpc.cli.context import Ctx
from xhpc.config import load_config
from xhpc.errors import ConfigError, XhpcError
from xhpc.settings import XhpcConfig


class _Cli(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        ctx.meta[config_check.ARGS_META] = list(rest)  # after the subcommand's name
        return rest


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
@click.pass_context
def cli(ctx: click.Context, site: Path | None, debug: bool) -> None:
    """xhpc: serve open LLMs on Slurm behind an OpenAI-compatible endpoint."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    ctx.meta[config_check.SITE_META] = site
    try:
        config, sources = load_config(site)
    except ConfigError:
        if not config_check.invoked(ctx):
            raise
        config, sources = XhpcConfig(), []  # `config check` loads it again and lists problems
    ctx.obj = Ctx(config=config, sources=sources, debug=debug)


cli.add_command(serve.serve)
cli.add_command(doctor.doctor)
cli.add_command(scale.scale)
cli.add_command(keys.keys)
cli.add_command(keys.usage)
for command in (*commands.ALL, *daemons.ALL):
    cli.add_command(command)
commands.config.add_command(config_check.check)


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        rv = cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except XhpcError as err:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {err.one_line()}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
