"""`xhpc cache ls|rm|prune`: the weights cache ledger (the shared store and nodes' copies)."""

from __future__ import annotations

import click
from rich.table import Table

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.client.control import request_of
from xhpc.weights import CacheOutcome, CachePrune, CacheRemove, format_size, parse_size


def _flag(field: str) -> str:
    return {"budget_bytes": "--budget"}.get(field, "--" + field.replace("_", "-"))


@click.group()
def cache() -> None:
    """The weights cache: the shared store's models and nodes' local copies (ls for anyone;
    rm and prune for admins)."""


@cache.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def ls(ctx: Ctx, as_json: bool) -> None:
    """Every copy: the shared store's and each node's, with size, digest, last use, users."""
    copies = ctx.broker.cache_copies()
    if as_json:
        emit_json([c.model_dump(mode="json") for c in copies])
        return
    table = Table()
    for col in ("model", "where", "size", "digest", "last use", "users", "path"):
        table.add_column(col)
    for c in copies:
        users = ", ".join(f"{u}*" if u in c.in_use_by else u for u in c.users)
        table.add_row(
            c.model,
            c.where,
            format_size(c.size_bytes),
            c.digest.removeprefix("sha256:")[:12],
            c.last_used_at.strftime("%Y-%m-%d %H:%M") if c.last_used_at else "-",
            users or "-",
            c.path,
        )
    ctx.console.print(table)
    if any(c.in_use_by for c in copies):
        click.echo("* alive now: its copy is never removed")


def _report(outcome: CacheOutcome, as_json: bool) -> None:
    if as_json:
        emit_json(outcome.model_dump(mode="json"))
        return
    verb = "would remove" if outcome.dry_run else "removing"
    for c in outcome.removed:
        click.echo(f"{verb} {c.model} on {c.where} ({format_size(c.size_bytes)})")
    for line in outcome.kept:
        click.echo(f"kept: {line}")
    if not outcome.removed and not outcome.kept:
        click.echo("nothing to remove")


@cache.command("rm")
@click.argument("model")
@click.option("--node", default=None, help="Only this node's copy (default: every node's).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def rm(ctx: Ctx, model: str, node: str | None, dry_run: bool, as_json: bool) -> None:
    """Remove MODEL's node-local copies (never one a live replica uses; never the shared store)."""
    fields: dict[str, object] = {"model": model, "node": node, "dry_run": dry_run}
    _report(ctx.broker.cache_rm(request_of(CacheRemove, fields, _flag)), as_json)


@cache.command("prune")
@click.option("--budget", required=True, help="Most each node keeps, e.g. 200G.")
@click.option("--node", default=None, help="Only this node (default: every node).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def prune(ctx: Ctx, budget: str, node: str | None, dry_run: bool, as_json: bool) -> None:
    """Keep each node's local copies under --budget, least recently used removed first (never
    one a live replica uses)."""
    fields: dict[str, object] = {
        "budget_bytes": parse_size(budget),
        "node": node,
        "dry_run": dry_run,
    }
    _report(ctx.broker.cache_prune(request_of(CachePrune, fields, _flag)), as_json)
