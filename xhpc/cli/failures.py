"""How a failed command ends: one `error:` line on stderr, the same error as an OpenAI-shaped
object on stdout under `--json` (xhpc.errors.error_body), and the exit code of its kind.

Click's usage errors (a missing argument, an unknown option, a value of the wrong type) end the
same way, with exit code 2 and a hint to the command's `--help`, instead of click's usage block.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import click

from xhpc.errors import BrokerUnavailableError, XhpcError, error_body

USAGE_CODE = "usage_error"
_NEGATIVE = re.compile(r"-\d+(\.\d+)?")


def json_requested(argv: Sequence[str]) -> bool:
    """Did the command line ask for `--json` (before any `--`)?"""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _sentence(text: str) -> str:
    """One line, lower-case start (unless a word in capitals starts it), no final period."""
    text = " ".join(text.split()).rstrip(".")
    if len(text) > 1 and text[0].isupper() and text[1].islower():
        text = text[0].lower() + text[1:]
    return text


def usage_message(err: click.UsageError) -> tuple[str, str | None]:
    """A usage error as one line with a hint to `--help`, and the parameter it is about."""
    param: str | None = None
    if isinstance(err, click.NoSuchOption) and _NEGATIVE.fullmatch(err.option_name):
        text = f"{err.option_name}: negative numbers are not allowed here"
        param = err.option_name
    else:
        text = _sentence(err.format_message())
        if isinstance(err, click.NoSuchOption):
            param = err.option_name
        elif isinstance(err, click.BadParameter | click.MissingParameter) and err.param:
            opts = getattr(err.param, "opts", None) or [err.param.name or ""]
            param = opts[0] or None
    command = err.ctx.command_path if err.ctx is not None else "xhpc"
    return f"{text} (hint: see `{command} --help`)", param


def fail(
    line: str,
    *,
    exit_code: int,
    error_type: str,
    code: str,
    as_json: bool,
    param: str | None = None,
) -> None:
    """Print the error (stderr; and stdout as JSON when asked) and exit with ``exit_code``."""
    if as_json:
        body = error_body(line, type_=error_type, code=code, param=param)
        click.echo(json.dumps(body, indent=2))
    click.echo(f"error: {line}", err=True)
    raise SystemExit(exit_code)


def fail_usage(err: click.UsageError, as_json: bool) -> None:
    line, param = usage_message(err)
    fail(
        line,
        exit_code=err.exit_code,
        error_type="invalid_request_error",
        code=USAGE_CODE,
        as_json=as_json,
        param=param,
    )


def fail_xhpc(err: XhpcError, as_json: bool) -> None:
    fail(
        err.one_line(),
        exit_code=err.exit_code,
        error_type=err.error_type,
        code=err.code,
        as_json=as_json,
    )


def explain_unavailable(err: BrokerUnavailableError, site_file: Path | None) -> None:
    """No broker at the default state directory and no site config given: most often the
    broker runs with one (so in its state directory), and starting another here is not what
    the user wants. Say so in the hint, instead of inviting a second broker."""
    from xhpc.config import site_file_of

    if err.state_dir is None or site_file_of(site_file) is not None:
        return
    err.hint = (
        "no site config was given, so this is not the state directory of a broker started "
        "with one; give the broker's site config: --site FILE or export "
        'XHPC_SITE_CONFIG=FILE (the dev cluster: eval "$(scripts/dev-cluster env)")'
    )
