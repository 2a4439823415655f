"""`xhpc scale NAME N`: add replicas, or drain the least loaded ones and stop them.
`xhpc scale NAME --min A --max B ...`: change an autoscaled deployment's policy in place (or
make a fixed one autoscaled)."""

from __future__ import annotations

import click

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.cli.deploy.serve import SCALING_FLAGS, scaling_options
from xhpc.client.control import request_of
from xhpc.models import ScalingChange


@click.command()
@click.argument("name")
@click.argument("replicas", type=int, required=False)
@scaling_options
@click.option("--detach", is_flag=True, help="Return once the change is submitted.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def scale(
    ctx: Ctx,
    name: str,
    replicas: int | None,
    detach: bool,
    timeout_s: float,
    as_json: bool,
    min_replicas: int | None,
    max_replicas: int | None,
    target_in_flight: float | None,
    ttft_s: float | None,
    idle_s: float | None,
    down_window_s: float | None,
) -> None:
    """Scale deployment NAME to REPLICAS replicas (the same number again changes nothing), or
    change its scaling policy: the knobs given, the others as they are."""
    knobs = {"min_replicas": min_replicas, "max_replicas": max_replicas,
             "target_in_flight": target_in_flight, "ttft_s": ttft_s, "idle_s": idle_s,
             "down_window_s": down_window_s}  # fmt: skip
    given: dict[str, object] = {k: v for k, v in knobs.items() if v is not None}
    if given:
        if replicas is not None:
            raise click.UsageError("give REPLICAS or scaling knobs (--min, --max, ...), not both")
        change = request_of(ScalingChange, given, lambda f: SCALING_FLAGS.get(f, f))
        view = ctx.broker.change_scaling(name, change)
        if as_json:
            emit_json(view.model_dump(mode="json"))
            return
        policy = view.scaling
        shown = policy.shown() if policy is not None else "fixed"
        click.echo(f"{name}: {shown}, {view.wanted} replica(s) wanted now")
        return
    if replicas is None:
        raise click.MissingParameter(param_hint="'REPLICAS'", param_type="argument")
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
    change_line = ", ".join(
        part
        for part in (
            f"added {' '.join(result.added)}" if result.added else "",
            f"drained and stopped {' '.join(result.removed)}" if result.removed else "",
        )
        if part
    )
    click.echo(f"{name}: {result.previous} -> {result.target} replica(s); {change_line}")
