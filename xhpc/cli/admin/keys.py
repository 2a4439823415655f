"""`xhpc keys create|list|revoke` (admins) and `xhpc usage`: API keys for the gateway."""

from __future__ import annotations

import click
from pydantic import TypeAdapter
from rich.table import Table

from xhpc.access import KeyCreate, KeyView, UsageLine
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.cli.deploy.serve import build_request_of

_keys = TypeAdapter(list[KeyView])
_usage = TypeAdapter(list[UsageLine])


@click.group()
def keys() -> None:
    """API keys for the OpenAI gateway (admins only): bound to a user and a Slurm account."""


@keys.command("create")
@click.option("--user", required=True, help="The lab member (a Unix user) the key belongs to.")
@click.option(
    "--account",
    default=None,
    help="The Slurm account it is charged to: one of the user's associations (sacctmgr).",
)
@click.option("--rpm", default=None, type=int, help="Requests per minute (default: no limit).")
@click.option("--token-quota", default=None, type=int, help="Tokens in all (default: no limit).")
@click.option(
    "--max-concurrent",
    default=None,
    type=int,
    help="Requests in flight at once, per proxy worker (default: no limit).",
)
@click.option("--admin", is_flag=True, help="May use every model.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def create(
    ctx: Ctx,
    user: str,
    account: str | None,
    rpm: int | None,
    token_quota: int | None,
    max_concurrent: int | None,
    admin: bool,
    as_json: bool,
) -> None:
    """Create a key; it is printed once and only its digest is kept."""
    fields = {
        "user": user,
        "account": account,
        "rpm": rpm,
        "token_quota": token_quota,
        "max_concurrent": max_concurrent,
    }
    req = build_request_of(KeyCreate, {**fields, "admin": admin})
    made = ctx.broker.create_key(req)
    if made.warning:
        click.echo(f"warning: {made.warning}", err=True)
    if as_json:
        emit_json(made.model_dump(mode="json"))
        return
    click.echo(f"key {made.view.key_id} for {made.view.user} (shown once, keep it safe):")
    click.echo(made.key)


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def list_keys(ctx: Ctx, as_json: bool) -> None:
    """List keys (never their secrets)."""
    views = ctx.broker.keys()
    if as_json:
        emit_json([v.model_dump(mode="json") for v in views])
        return
    table = Table()
    columns = ("key", "user", "account", "admin", "rpm", "token quota", "concurrent")
    for col in (*columns, "created", "revoked"):
        table.add_column(col)
    for v in views:
        table.add_row(
            v.key_id,
            v.user,
            v.account or "-",
            "yes" if v.admin else "",
            str(v.rpm or "-"),
            str(v.token_quota or "-"),
            str(v.max_concurrent or "-"),
            v.created_at.strftime("%Y-%m-%d %H:%M"),
            v.revoked_at.strftime("%Y-%m-%d %H:%M") if v.revoked_at else "",
        )
    ctx.console.print(table)


@keys.command("revoke")
@click.argument("key_id")
@pass_ctx
def revoke(ctx: Ctx, key_id: str) -> None:
    """Revoke a key: proxies refuse it from their next sync (about a second)."""
    view = ctx.broker.revoke_key(key_id)
    click.echo(f"key {view.key_id} of {view.user} revoked")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def usage(ctx: Ctx, as_json: bool) -> None:
    """Requests and tokens per key, user, account and model, next to the GPU-hours Slurm
    accounting charged for the model's jobs (key "-": GPU-hours no single key's line carries;
    n/a: Slurm keeps no accounting). Yours; admins see all."""
    lines = ctx.broker.usage()
    if as_json:
        emit_json([u.model_dump(mode="json") for u in lines])
        return
    table = Table()
    columns = ("key", "user", "account", "model", "requests", "prompt tok", "completion tok")
    for col in (*columns, "GPU-h"):
        table.add_column(col)
    for u in lines:
        table.add_row(
            u.key_id,
            u.user,
            u.account or "-",
            u.model,
            str(u.requests),
            str(u.prompt_tokens),
            str(u.completion_tokens),
            "n/a" if u.gpu_hours is None else f"{u.gpu_hours:.3f}",
        )
    ctx.console.print(table)
