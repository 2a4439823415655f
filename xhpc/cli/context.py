"""What every command gets: the loaded config and a broker client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from xhpc.cli.meta import SITE_META
from xhpc.client.http import BrokerTransport
from xhpc.config import locate_state_dir
from xhpc.paths import control_socket_path, control_socket_path_in

if TYPE_CHECKING:  # pydantic: the commands that only ask the broker never build it
    from xhpc.client.control import Client
    from xhpc.settings import XhpcConfig


@dataclass
class Ctx:
    config: XhpcConfig
    sources: list[str]
    debug: bool = False

    @property
    def broker(self) -> Client:
        from xhpc.client.control import Client

        return Client.of_state_dir(self.config.resolved_state_dir)

    @property
    def console(self) -> Console:
        return console()


pass_ctx = click.make_pass_decorator(Ctx)


def console() -> Console:
    # Piped output (CI logs, `| less`) gets wide tables instead of truncated cells.
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def broker_of(ctx: click.Context) -> BrokerTransport:
    """The broker's client for a command the group loads no config for (`BROKER_ONLY` in
    xhpc/cli/main.py): its socket in the state directory of the same config layers, read
    without validating the rest (xhpc.config.locate_state_dir); a Ctx's own when there is one."""
    given = ctx.find_object(Ctx)
    if given is not None:
        return BrokerTransport(control_socket_path(given.config))
    return BrokerTransport(control_socket_path_in(locate_state_dir(ctx.meta.get(SITE_META))))


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
