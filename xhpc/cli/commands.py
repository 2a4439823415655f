"""`xhpc ps | stop | logs | config`."""

from __future__ import annotations

import json
import time

import click
from pydantic import TypeAdapter
from rich.table import Table

from xhpc.cli.config_check import check
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.errors import XhpcError
from xhpc.models import DeploymentView, LogsView, NodeInfo, PilotView, ReplicaState, ReplicaView
from xhpc.states import TERMINAL

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
_replicas = TypeAdapter(list[ReplicaView])
_deployments = TypeAdapter(list[DeploymentView])
_nodes = TypeAdapter(list[NodeInfo])
_pilots = TypeAdapter(list[PilotView])


def _show_pilots(ctx: Ctx, as_json: bool) -> None:
    pilots = _pilots.validate_python(ctx.broker.get("/v1/pilots"))
    if as_json:
        emit_json([p.model_dump(mode="json") for p in pilots])
        return
    table = Table(title="pilot jobs")
    for col in ("pilot", "node", "gpus", "state", "job", "devices", "replicas"):
        table.add_column(col)
    for p in pilots:
        table.add_row(
            p.pilot_id,
            p.node,
            str(p.gpus),
            p.state.value,
            p.job_id or "-",
            ",".join(map(str, p.devices)) or "-",
            ", ".join(p.replicas) or "-",
        )
    ctx.console.print(table)


@click.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and failed replicas.")
@click.option("--pilots", "show_pilots", is_flag=True, help="List pilot jobs instead.")
@json_option
@pass_ctx
def ps(ctx: Ctx, show_all: bool, show_pilots: bool, as_json: bool) -> None:
    """List replicas and their states (or, with --pilots, the pilot jobs)."""
    if show_pilots:
        _show_pilots(ctx, as_json)
        return
    rows = _replicas.validate_python(ctx.broker.get(f"/v1/replicas?all={int(show_all)}"))
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table()
    for col in (
        "replica",
        "deployment",
        "role",
        "state",
        "engine",
        "job",
        "node",
        "gpus",
        "endpoint",
        "detail",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.replica_id,
            r.deployment,
            f"{r.role.value} of {r.unit}" if r.role else "-",
            r.state.value,
            r.engine.value,
            r.job_id or "-",
            r.node or "-",
            ",".join(map(str, r.gpus)) or "-",
            r.endpoint or "-",
            r.reason or "",
        )
    ctx.console.print(table)
    for line in deployment_notes(_deployments.validate_python(ctx.broker.get("/v1/deployments"))):
        ctx.console.print(line, markup=False, highlight=False)


def deployment_notes(deps: list[DeploymentView]) -> list[str]:
    """One line per deployment that is not what its owner asked for: failed, or short of
    READY replicas (being replaced, waiting in the queue)."""
    lines: list[str] = []
    for d in deps:
        if d.failed_reason:
            lines.append(f"{d.name}: FAILED: {d.failed_reason}")
            continue
        if any(r.role is not None for r in d.replicas):
            continue  # PD: `wanted` counts units, not instances (shown per unit in the table)
        ready = sum(r.state is ReplicaState.READY for r in d.replicas)
        if not d.stopped and d.wanted and ready < d.wanted:
            lines.append(f"{d.name}: {ready} of {d.wanted} replica(s) READY (restart={d.restart})")
    return lines


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
