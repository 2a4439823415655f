"""`xhpc models list | show | add | rm`: the site's model catalog and the member's own.

The site catalog (`[models.NAME]` in the config files) is read-only here; `add` and `rm` change
only the member's own file (xhpc.config.user_catalog_path). Decision 0020."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
from rich.table import Table

from xhpc.catalog import (
    CatalogEntry,
    catalog_entries,
    engine_word_problems,
    find_entry,
    new_user_entry,
    shadow_warning,
    weights_of,
)
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.client.control import request_of
from xhpc.config import load_user_catalog, save_user_catalog, user_catalog_path
from xhpc.engine_config import engine_config_of
from xhpc.errors import BrokerUnavailableError, NotFoundError, ValidationError
from xhpc.models import EngineKind
from xhpc.settings import ModelEntry, XhpcConfig

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
ENGINES = ", ".join(e.value for e in EngineKind)


def _engine(row: CatalogEntry, config: XhpcConfig) -> EngineKind:
    return row.entry.engine or config.default_engine


Cached = dict[str, list[str]] | None  # weights name -> "shared" and nodes; None: no broker


def _cached(ctx: Ctx) -> Cached:
    """Where the weights cache holds each model's weights, as the broker's ledger says; None
    when no broker answers (the catalogs themselves need none)."""
    try:
        copies = ctx.broker.cache_copies()
    except BrokerUnavailableError:
        return None
    where: dict[str, list[str]] = {}
    for c in copies:
        where.setdefault(c.model, []).append(c.node or "shared")
    return where


def _cached_at(row: CatalogEntry, config: XhpcConfig, cached: Cached) -> list[str] | None:
    if cached is None:
        return None
    path = weights_of(row, config)  # a member's entry is served as its directory, by its name
    names = (row.name,) if row.source == "site" or path is None else (row.name, path.name)
    return sorted({at for name in names for at in cached.get(name, [])})


def _summary(row: CatalogEntry, config: XhpcConfig, cached: Cached = None) -> dict[str, object]:
    return {
        "name": row.name,
        "source": row.source,
        "engine": _engine(row, config).value,
        "gpus": row.entry.gpus or 1,
        "shadowed": row.shadowed,
        "description": row.entry.description,
        "cached": _cached_at(row, config, cached),  # null: no broker to ask
    }


def _details(row: CatalogEntry, config: XhpcConfig, cached: Cached = None) -> dict[str, object]:
    engine = _engine(row, config)
    path = weights_of(row, config)
    cfg = row.entry.engine_config
    staged = path is not None and (path / "config.json").is_file()
    return {
        **_summary(row, config, cached),
        "engine_set": row.entry.engine is not None,  # false: the site's default_engine
        "gpus_set": row.entry.gpus is not None,  # false: 1, the default of --gpus
        "path": None if path is None else str(path),
        "staged": staged,
        "hf_id": row.entry.hf_id,
        "served_name": row.name,
        # what the engine is started with: the site's [engines.ENGINE] args, then the model's
        "site_engine_args": list(config.engine(engine).args),
        "engine_args": list(row.entry.engine_args),
        # how the engine serves it (typed), and the options it becomes
        "engine_config": cfg.model_dump(mode="json", exclude_defaults=True) if cfg else None,
        "engine_config_args": list(cfg.argv(str(path or ""))) if cfg else [],
    }


def _where(at: object) -> str:
    """Where the cache holds the weights: "shared, n1", "-" (nowhere), "?" (no broker)."""
    return "?" if not isinstance(at, list) else ", ".join(at) or "-"


def _flag(field: str) -> str:
    """The `add` option a ModelEntry field comes from (``engine_args.0``: --engine-arg)."""
    name = field.split(".")[0]
    return "--engine-arg" if name == "engine_args" else "--" + name.replace("_", "-")


@click.group()
def models() -> None:
    """The model catalog: the site's (read-only) and your own (add, rm)."""


@models.command("list")
@json_option
@pass_ctx
def list_models(ctx: Ctx, as_json: bool) -> None:
    """List the models of both catalogs: name, engine, GPUs per replica, source, and where the
    weights cache holds them (the shared store, nodes; "?": no broker answered)."""
    rows = catalog_entries(ctx.config, load_user_catalog())
    for r in rows:
        if r.shadowed:
            click.echo(f"warning: {shadow_warning(r.name)}", err=True)
    cached = _cached(ctx)
    if as_json:
        emit_json([_summary(r, ctx.config, cached) for r in rows])
        return
    table = Table()
    for col in ("name", "engine", "gpus", "source", "cached", "description"):
        table.add_column(col)
    for r in rows:
        source = "user (hidden by site)" if r.shadowed else r.source
        engine = _engine(r, ctx.config).value + ("" if r.entry.engine else " (default)")
        gpus = str(r.entry.gpus or 1)
        where = _where(_cached_at(r, ctx.config, cached))
        table.add_row(r.name, engine, gpus, source, where, r.entry.description)
    ctx.console.print(table)


@models.command("show")
@click.argument("name")
@json_option
@pass_ctx
def show(ctx: Ctx, name: str, as_json: bool) -> None:
    """Show everything about model NAME: engine, resources, arguments, weights, served name."""
    user = load_user_catalog()
    row = find_entry(name, ctx.config, user)
    data = _details(row, ctx.config, _cached(ctx))
    if row.name in user and row.source == "site":
        click.echo(f"warning: {shadow_warning(row.name)}", err=True)
    if as_json:
        emit_json(data)
        return
    width = 18
    lines = [
        ("name", row.name),
        ("source", f"{row.source} catalog"),
        ("description", row.entry.description or "-"),
        ("engine", data["engine"] if row.entry.engine else f"{data['engine']} (site default)"),
        ("gpus per replica", f"{data['gpus']}" + ("" if row.entry.gpus else " (default)")),
        ("site engine args", " ".join(ctx.config.engine(_engine(row, ctx.config)).args) or "-"),
        ("model engine args", " ".join(row.entry.engine_args) or "-"),
        ("engine config", shlex.join(data["engine_config_args"]) or "-"),  # type: ignore[arg-type]
        ("hf_id", row.entry.hf_id or "-"),
        ("path", f"{data['path'] or '- (models_dir is not set)'}"),
        ("staged", "yes" if data["staged"] else "no"),
        ("cached", _where(data["cached"])),
        ("served as", f"{row.name} (the `model` clients send; `serve --name` changes it)"),
    ]
    for key, value in lines:
        click.echo(f"{key:<{width}} {value}")


@models.command("add")
@click.argument("name")
@click.option("--path", "path", default=None, help="The weights' directory (Hugging Face format).")
@click.option("--hf-id", default=None, help="The Hugging Face id the weights come from.")
@click.option("--engine", default=None, help=f"The engine that serves it ({ENGINES}).")
@click.option("--gpus", default=None, type=int, help="GPUs per replica when serve has no --gpus.")
@click.option("--engine-arg", "engine_args", multiple=True, help="Engine argument (repeatable).")
@click.option(
    "--engine-config",
    "engine_config",
    default=None,
    metavar="JSON",
    help="How the engine serves it: a JSON object of the keys of docs/engines.md "
    '(e.g. \'{"tool_call_parser": "hermes"}\').',
)
@click.option("--description", default="", help="One line for `xhpc models list`.")
@json_option
@pass_ctx
def add(
    ctx: Ctx,
    name: str,
    path: str | None,
    hf_id: str | None,
    engine: str | None,
    gpus: int | None,
    engine_args: tuple[str, ...],
    engine_config: str | None,
    description: str,
    as_json: bool,
) -> None:
    """Add model NAME to your own catalog (the site catalog is read-only to members)."""
    if engine is not None and engine not in {e.value for e in EngineKind}:
        raise ValidationError(f"unknown engine {engine!r}; engines: {ENGINES}")
    if path is not None and not path.isprintable():
        raise ValidationError(f"invalid --path {path!r}: control characters are not allowed")
    odd = engine_word_problems(engine_args)
    if odd:
        raise ValidationError(f"--engine-arg: {'; '.join(odd)}")
    fields: dict[str, object] = {
        "path": None if path is None else str(Path(path).expanduser().resolve()),
        "hf_id": hf_id,
        "engine": engine,
        "gpus": gpus,
        "engine_args": list(engine_args),
        "description": description,
    }
    if engine_config:
        fields["engine_config"] = engine_config_of(engine_config, "--engine-config")
    entry = request_of(ModelEntry, fields, _flag)
    user = load_user_catalog()
    entry = new_user_entry(name, entry, ctx.config, user)
    written = save_user_catalog({**user, name: entry})
    if as_json:
        emit_json({"name": name, "file": str(written), **entry.model_dump(mode="json")})
        return
    click.echo(f"added {name} to {written}")


@models.command("rm")
@click.argument("name")
@json_option
@pass_ctx
def rm(ctx: Ctx, name: str, as_json: bool) -> None:
    """Remove model NAME from your own catalog (site models are the site's admins' to change)."""
    user = load_user_catalog()
    if name not in user:
        if name in ctx.config.models:
            raise ValidationError(
                f"model {name!r} is in the site catalog, which members cannot change",
                hint="ask your site's admins; `xhpc models rm` removes only your own models",
            )
        raise NotFoundError(
            f"model {name!r} is not in your catalog ({user_catalog_path()})",
            hint=f"yours: {', '.join(sorted(user)) or 'none'}",
        )
    rest = {n: e for n, e in user.items() if n != name}
    written = save_user_catalog(rest)
    if as_json:
        emit_json({"name": name, "file": str(written), "removed": True})
        return
    click.echo(f"removed {name} from {written}")
