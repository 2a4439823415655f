"""`xhpc stop | logs | config` (`xhpc ps`: xhpc/cli/observe/ps.py)."""

from __future__ import annotations

import click

from xhpc.cli.config_check import check, example
from xhpc.cli.context import Ctx, emit_json, pass_ctx

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.command()
@click.argument("target")
@click.option("--no-wait", is_flag=True, help="Return once the jobs are cancelled.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True)
@json_option
@pass_ctx
def stop(ctx: Ctx, target: str, no_wait: bool, timeout_s: float, as_json: bool) -> None:
    """Stop a deployment (MODEL) or one REPLICA: drain, cancel its jobs, wait for STOPPED."""
    broker = ctx.broker
    rows = broker.stop(target)
    if not no_wait:
        rows = broker.wait_stopped(rows, target, timeout_s)
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
    view = ctx.broker.logs(replica, lines)
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
config.add_command(example)
