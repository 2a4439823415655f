"""`xhpc state backup | restore | show`: the broker's state as one file, and back."""

from __future__ import annotations

from pathlib import Path

import click

from xhpc import __version__
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.store.backup import BackupManifest, backup, read_manifest, restore

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group()
def state() -> None:
    """The broker's state: a consistent backup to one file, and its restore."""


def _said(verb: str, path: Path, m: BackupManifest, as_json: bool) -> None:
    if as_json:
        emit_json({"file": str(path), **m.model_dump(mode="json")})
        return
    click.echo(
        f"{verb} {path}: broker {m.broker_id}, {m.deployments} deployment(s), {m.replicas} "
        f"active replica(s), schema {m.schema_version} (xhpc {m.xhpc_version}, "
        f"{m.made_at:%Y-%m-%d %H:%M:%S} UTC)"
    )


@state.command("backup")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@json_option
@pass_ctx
def backup_cmd(ctx: Ctx, file: Path, as_json: bool) -> None:
    """Write a consistent snapshot of the state to FILE (new; owner-only), the broker running
    or not."""
    cfg = ctx.config
    made = backup(cfg.store_target, cfg.resolved_state_dir, file, __version__)
    _said("wrote", file, made, as_json)


@state.command("restore")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@json_option
@pass_ctx
def restore_cmd(ctx: Ctx, file: Path, as_json: bool) -> None:
    """Restore FILE into this state directory, which must hold no state and no running broker;
    the broker started then adopts the backup's running jobs."""
    cfg = ctx.config
    _said("restored", file, restore(file, cfg.store_target, cfg.resolved_state_dir), as_json)


@state.command("show")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@json_option
def show(file: Path, as_json: bool) -> None:
    """What a backup FILE holds."""
    _said("backup", file, read_manifest(file), as_json)
