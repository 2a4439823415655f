"""What the `xhpc` group tells its subcommands through click's context (no heavy imports:
`xhpc --help` loads this and click only)."""

from __future__ import annotations

import click

SITE_META = "xhpc.site"  # the group's --site, for `config check` without FILE
ARGS_META = "xhpc.sub_args"  # what follows the subcommand's name on the command line
DEBUG_META = "xhpc.debug"  # the group's --debug, for commands that load no config
REMOTE_META = "xhpc.remote"  # the group's --remote options (xhpc.remote.argv.RemoteOptions)


def config_check_invoked(ctx: click.Context) -> bool:
    """Is this `xhpc config check` (or `example`)? The group then lets a broken config through
    to it."""
    return ctx.invoked_subcommand == "config" and ctx.meta.get(ARGS_META, [])[:1] in (
        ["check"],
        ["example"],
    )
