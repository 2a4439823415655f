"""`xhpc proxy`: the OpenAI-compatible gateway, as one process or a supervisor over workers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from xhpc.broker.server import control_socket_path
from xhpc.cli.context import Ctx, pass_ctx


@click.command()
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the URL the proxy listens on here once it does (useful with port 0).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes sharing the port (default: proxy.workers); 1: a single process.",
)
@pass_ctx
def proxy(ctx: Ctx, ready_file: Path | None, workers: int | None) -> None:
    """Run the OpenAI-compatible proxy in the foreground.

    With several workers, SIGHUP reloads them (fresh workers read the config again, then the
    old ones finish their requests) and SIGTERM stops them once their requests are done.
    """
    logging.getLogger().setLevel(logging.INFO)
    socket_path = control_socket_path(ctx.config)
    count = workers if workers is not None else ctx.config.proxy.workers
    if count == 1:
        from xhpc.proxy.server import run_proxy

        asyncio.run(run_proxy(ctx.config, socket_path, ready_file=ready_file))
        return
    from xhpc.proxy.supervisor import run_supervisor
    from xhpc.proxy.worker import WorkerCommand

    root = click.get_current_context().find_root().params
    command = WorkerCommand(socket_path, site=root.get("site"), debug=bool(root.get("debug")))
    asyncio.run(run_supervisor(ctx.config.proxy, count, command, ready_file=ready_file))
