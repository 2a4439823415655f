"""`xhpc scale NAME N`: add replicas, or drain the least loaded ones and stop them."""

from __future__ import annotations

import click

from xhpc.cli.context import Ctx, emit_json, pass_ctx


@click.command()
@click.argument("name")
@click.argument("replicas", type=int)
@click.option("--detach", is_flag=True, help="Return once the change is submitted.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def scale(
    ctx: Ctx, name: str, replicas: int, detach: bool, timeout_s: float, as_json: bool
) -> None:
    """Scale deployment NAME to REPLICAS replicas (the same number again changes nothing)."""
    broker = ctx.broker
    result = broker.scale(name, replicas)
    if not detach and (result.added or result.removed):
        broker.wait_scaled(result, timeout_s)
    if as_json:
        emit_json(result.model_dump(mode="json"))
        return
    if not result.added and not result.removed:
        click.echo(f"{name}: already at {result.target} replica(s); nothing to do")
        return
    change = ", ".join(
        part
        for part in (
            f"added {' '.join(result.added)}" if result.added else "",
            f"drained and stopped {' '.join(result.removed)}" if result.removed else "",
        )
        if part
    )
    click.echo(f"{name}: {result.previous} -> {result.target} replica(s); {change}")
