"""`xhpc stop | logs | config` (`xhpc ps`: xhpc/cli/ps.py)."""

from __future__ import annotations

import json
import time

import click
from pydantic import TypeAdapter

from xhpc.cli.config_check import check
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.errors import XhpcError
from xhpc.models import LogsView, ReplicaView
from xhpc.states import TERMINAL

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
_replicas = TypeAdapter(list[ReplicaView])


@click.command()
@click.argument("target")
@click.option("--no-wait", is_flag=True, help="Return once the jobs are cancelled.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True)
@json_option
@pass_ctx
def stop(ctx: Ctx, target: str, no_wait: bool, timeout_s: float, as_json: bool) -> None:
    """Stop a deployment (MODEL) or one REPLICA: drain, cancel its jobs, wait for STOPPED."""
    rows = _replicas.validate_python(ctx.broker.post("/v1/stop", json.dumps({"target": target})))
    ids = {r.replica_id for r in rows}
    deadline = time.monotonic() + timeout_s
    while not no_wait and any(r.state not in TERMINAL for r in rows):
        if time.monotonic() > deadline:
            raise XhpcError(f"replicas of {target} not stopped after {timeout_s:.0f}s")
        time.sleep(0.5)
        every = _replicas.validate_python(ctx.broker.get("/v1/replicas?all=1"))
        rows = [r for r in every if r.replica_id in ids]
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    for r in rows:
        click.echo(f"{r.replica_id}: {r.state.value}")


@click.command()
@click.argument("replica")
@click.option("--lines", default=200, show_default=True)
@json_option
@pass_ctx
def logs(ctx: Ctx, replica: str, lines: int, as_json: bool) -> None:
    """Show a replica's job output and engine log."""
    view = LogsView.model_validate(ctx.broker.get(f"/v1/replicas/{replica}/logs?lines={lines}"))
    if as_json:
        emit_json(view.model_dump(mode="json"))
        return
    click.echo(f"==> job output ({replica}) <==")
    click.echo(view.job_output)
    click.echo(f"==> engine log ({replica}) <==")
    click.echo(view.engine_log)


@click.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--sources", is_flag=True, help="List the files and layers that were read.")
@pass_ctx
def config_show(ctx: Ctx, sources: bool) -> None:
    """Print the effective configuration as JSON."""
    data = ctx.config.model_dump(mode="json")
    if sources:
        data = {"sources": ctx.sources, "config": data}
    emit_json(data)


config.add_command(check)
