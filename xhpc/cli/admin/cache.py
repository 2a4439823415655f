"""`xhpc cache ls|rm|prune|pull`: the weights cache ledger (the shared store and nodes' copies)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from rich.table import Table

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.client.control import request_of
from xhpc.errors import ValidationError, XhpcError
from xhpc.weights import (
    HUB_MESSAGE,
    CacheOutcome,
    CachePrune,
    CachePull,
    CacheRemove,
    PullStatus,
    PullView,
    format_size,
    hub_source,
    parse_size,
)

WAIT_POLL_S = 1.0  # `cache pull --wait`: how often the broker is asked about the job


def _flag(field: str) -> str:
    spelled = {"budget_bytes": "--budget", "source": "--from", "model": "MODEL"}
    return spelled.get(field, "--" + field.replace("_", "-"))


@click.group()
def cache() -> None:
    """The weights cache: the shared store's models and nodes' local copies (ls for anyone;
    rm, prune and pull for admins)."""


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


@cache.command("pull")
@click.argument("model")
@click.option(
    "--from", "source", required=True, metavar="DIR", help="A model directory on this machine."
)
@click.option("--replace", is_flag=True, help="Overwrite a different copy already in the store.")
@click.option("--wait", is_flag=True, help="Wait for the job to end; print the recorded copy.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def pull(ctx: Ctx, model: str, source: str, replace: bool, wait: bool, as_json: bool) -> None:
    """Copy DIR into the site's shared model store as <models_dir>/MODEL, by a Slurm job
    (admins; offline: DIR is a directory here, not a hub). The copy is checked by digest and
    renamed into place, then recorded in the ledger (xhpc cache ls)."""
    path = Path(source).expanduser()
    if hub_source(source, exists=os.path.lexists(path)):
        raise ValidationError(HUB_MESSAGE.format(source=source))
    fields: dict[str, object] = {
        "model": model,
        "source": os.path.abspath(path),  # not resolved: the broker refuses a symlink
        "replace": replace,
    }
    view = ctx.broker.cache_pull(request_of(CachePull, fields, _flag))
    if wait:
        while view.status is PullStatus.SUBMITTED:
            time.sleep(WAIT_POLL_S)
            view = ctx.broker.cache_pull_status(view.id)
        if view.status is PullStatus.FAILED:
            raise XhpcError(f"pull of {view.model} failed: {view.error}", hint=view.output)
    if as_json:
        emit_json(view.model_dump(mode="json"))
        return
    _pull_report(view)


def _pull_report(view: PullView) -> None:
    copy = view.recorded
    if view.status is PullStatus.SUBMITTED or copy is None:
        click.echo(f"pulling {view.source} into {view.path}: job {view.job_id}")
        click.echo("xhpc cache ls shows the copy once the job has made it")
        return
    verb = "already held" if view.unchanged else "replaced" if view.replaced else "pulled"
    click.echo(f"{verb} {copy.model}: {copy.path} ({format_size(copy.size_bytes)}, {copy.digest})")
