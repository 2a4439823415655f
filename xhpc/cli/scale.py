"""`xhpc scale NAME N`: add replicas, or drain the least loaded ones and stop them."""

from __future__ import annotations

import json
import time

import click

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.errors import XhpcError
from xhpc.models import DeploymentView, ReplicaState, ScaleResult

S = ReplicaState


def _settled(dep: DeploymentView, result: ScaleResult) -> bool:
    states = {r.replica_id: r.state for r in dep.replicas}
    failed = [rid for rid in result.added if states.get(rid) in (S.FAILED, S.LOST, S.STOPPED)]
    if failed:
        raise XhpcError(
            f"replica {failed[0]} is {states[failed[0]].value}",
            hint=f"see `xhpc logs {failed[0]}`",
        )
    added = all(states.get(rid) is S.READY for rid in result.added)
    removed = all(states.get(rid) in (S.STOPPED, S.FAILED) for rid in result.removed)
    return added and removed


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
    body = json.dumps({"name": name, "replicas": replicas})
    result = ScaleResult.model_validate(ctx.broker.post("/v1/scale", body))
    deadline = time.monotonic() + timeout_s
    while not detach and (result.added or result.removed):
        dep = DeploymentView.model_validate(ctx.broker.get(f"/v1/deployments/{name}"))
        if _settled(dep, result):
            break
        if time.monotonic() > deadline:
            raise XhpcError(f"scaling {name} not settled after {timeout_s:.0f}s")
        time.sleep(0.5)
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
