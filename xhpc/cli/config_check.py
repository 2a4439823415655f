"""`xhpc config check [FILE]`: load the config as every command does and list its problems."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import ErrorDetails

from xhpc.cli.meta import SITE_META
from xhpc.config import load_config, site_example, valid_keys
from xhpc.errors import ConfigError, plain_message


def _line(error: ErrorDetails) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        valid = ", ".join(valid_keys(error["loc"][:-1]))
        return f"{where}: unknown key; valid keys: {valid}"
    got = repr(error["input"])
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{where}: {plain_message(error['msg'])} (got {got})"


def problems(site: Path | None) -> tuple[list[str], str | None]:
    """Every problem of the layered config (packaged defaults, the site file ``site`` or
    $XHPC_SITE_CONFIG, the user file, XHPC_* variables), one line each, and the sources read."""
    try:
        load_config(site)
    except ConfigError as err:
        cause = err.__cause__
        if isinstance(cause, PydanticValidationError):
            return [_line(e) for e in cause.errors()], err.hint
        return [err.one_line()], None
    return [], None


@click.command("check")
@click.argument("file", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.pass_context
def check(ctx: click.Context, file: Path | None) -> None:
    """Check the config: FILE as the site file (default: --site, else $XHPC_SITE_CONFIG), with
    the packaged defaults, the user file and XHPC_* variables, as every command loads it.
    Prints "ok", or one line per problem and exits with status 2."""
    found, sources = problems(file or ctx.meta.get(SITE_META))
    if not found:
        click.echo("ok")
        return
    for line in found:
        click.echo(line)
    if sources:
        click.echo(sources, err=True)
    ctx.exit(ConfigError.exit_code)


@click.command("example")
def example() -> None:
    """Print a worked example of a GPU site's file (packaged with xhpc): start from it,
    then `xhpc config check FILE`."""
    click.echo(site_example(), nl=False)
