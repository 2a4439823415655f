"""What every command gets: the loaded config and a broker client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Console

from xhpc.cli.client import BrokerClient
from xhpc.paths import control_socket_path
from xhpc.settings import XhpcConfig


@dataclass
class Ctx:
    config: XhpcConfig
    sources: list[str]
    debug: bool = False

    @property
    def broker(self) -> BrokerClient:
        return BrokerClient(control_socket_path(self.config))

    @property
    def console(self) -> Console:
        # Piped output (CI logs, `| less`) gets wide tables instead of truncated cells.
        probe = Console()
        return probe if probe.is_terminal else Console(width=200)


pass_ctx = click.make_pass_decorator(Ctx)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
