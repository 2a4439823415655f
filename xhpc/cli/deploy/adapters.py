"""`xhpc adapters add|list|rm`: LoRA adapters served by name on a deployment's replicas."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import ValidationError as PydanticValidationError
from rich.table import Table

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.errors import first_problem
from xhpc.records import AdapterAdd


@click.group()
def adapters() -> None:
    """LoRA adapters on your deployments: each served by its own name on every READY replica of
    its base (which must have room for them: `engine_config.lora`), loaded while it runs."""


@adapters.command("add")
@click.argument("name")
@click.option("--base", required=True, help="The deployment (yours) whose replicas serve it.")
@click.option(
    "--path",
    "path",
    required=True,
    type=click.Path(path_type=Path),
    help="The adapter's directory (PEFT's: adapter_config.json, adapter_model.safetensors).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def add(ctx: Ctx, name: str, base: str, path: Path, as_json: bool) -> None:
    """Serve the adapter in DIR as NAME on deployment BASE's replicas."""
    try:
        req = AdapterAdd(name=name, base=base, path=str(path.absolute()))
    except PydanticValidationError as err:
        raise first_problem(err, "adapters add") from None
    added = ctx.broker.add_adapter(req)
    if as_json:
        emit_json(added.model_dump(mode="json"))
        return
    click.echo(f"adapter {added.name} on {added.base}: loaded on each READY replica shortly")


@adapters.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def list_(ctx: Ctx, as_json: bool) -> None:
    """Every adapter: its base, owner, path and the replicas that hold it now."""
    views = ctx.broker.adapters()
    if as_json:
        emit_json([v.model_dump(mode="json") for v in views])
        return
    table = Table()
    for col in ("adapter", "base", "owner", "loaded on", "path"):
        table.add_column(col)
    for v in views:
        table.add_row(v.name, v.base, v.owner, ", ".join(v.loaded_on) or "-", v.path)
    ctx.console.print(table)


@adapters.command("rm")
@click.argument("name")
@pass_ctx
def rm(ctx: Ctx, name: str) -> None:
    """Stop serving adapter NAME (yours): unloaded from its replicas."""
    gone = ctx.broker.remove_adapter(name)
    click.echo(f"adapter {gone.name} removed from {gone.base}")
