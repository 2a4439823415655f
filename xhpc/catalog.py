"""The model catalog: a name or a local path becomes a typed, resolved model."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from xhpc.engine_config import ModelEngineConfig
from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import NAME_RE, AgentSpec, EngineKind, ServeRequest, check_name
from xhpc.paths import broker_file_path
from xhpc.placement.layout import layout_engine_args
from xhpc.settings import ModelEntry, XhpcConfig

# One engine argument: one word of these characters, whatever the engine (docs/decisions/0019).
ENGINE_ARG_CHARS = "letters, digits and . _ - + = : , / @ %"
_ENGINE_ARG = re.compile(r"[A-Za-z0-9._+=:,/@%-]{1,256}")
_SHOWN = 5


def shown_names(items: Sequence[object]) -> str:
    """The first few of ``items``, and how many more."""
    shown = ", ".join(str(x) for x in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def engine_word(arg: str) -> bool:
    """Whether ``arg`` is one word of ``ENGINE_ARG_CHARS``."""
    return _ENGINE_ARG.fullmatch(arg) is not None


def engine_word_problems(args: Sequence[str]) -> list[str]:
    """What is wrong with request-given engine arguments, whatever the engine (admission, a
    member's catalog entry, in-allocation serving): each must be one word of
    ``ENGINE_ARG_CHARS`` (no control characters, blanks, quotes or shell metacharacters)."""
    problems: list[str] = []
    hostile = [repr(a) for a in args if not a.isprintable()]
    if hostile:
        problems.append(f"engine argument(s) {shown_names(hostile)} contain control characters")
    odd = [repr(a) for a in args if a.isprintable() and not engine_word(a)]
    if odd:
        problems.append(
            f"engine argument(s) {shown_names(odd)} are not allowed: each must be "
            f"one word of {ENGINE_ARG_CHARS} (at most 256; options with other values belong "
            "in the site config's [engines.NAME] args)"
        )
    return problems


class ResolvedModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    path: Path
    engine: EngineKind | None = None
    from_catalog: bool = True
    # What the weights cache calls these weights, whatever the deployment's name: the catalog
    # name, or a served directory's own name (None: the deployment's name).
    weights: str | None = None

    @property
    def weights_key(self) -> str:
        return self.weights or self.name


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _staged(path: Path) -> bool:
    """Whether ``path`` holds a model (its config.json); a path the caller may not read is an
    error of its own: models are read with the permissions of whoever serves them."""
    try:
        return (path / "config.json").is_file()
    except PermissionError as err:
        raise ValidationError(
            f"cannot read the model at {path}: permission denied",
            hint="a model is read with your own permissions; ask its owner to share it",
        ) from err


def engine_env_hint(engine: str) -> str:
    """How to make an engine's missing Python environment (admission and the agent say it)."""
    return (
        f"make it with `scripts/setup-engines {engine}` in an xhpc checkout, or point "
        f"[engines.{engine}] python at an existing environment"
    )


def resolve_model(model: str, config: XhpcConfig, name: str | None = None) -> ResolvedModel:
    """Resolve MODEL (a catalog name or a local path); hostile strings are refused here."""
    if not model or not model.isprintable():
        raise ValidationError(f"invalid model name {model!r}: control characters are not allowed")
    if _looks_like_path(model):
        try:
            path = Path(model).expanduser().resolve()
            staged = _staged(path)
        except (RuntimeError, OSError) as err:  # an unknown ~user, a symlink loop, too long
            shown = model if len(model) <= 80 else f"{model[:80]}..."
            raise NotFoundError(f"no model at {shown!r}: the path cannot be resolved") from err
        if not staged:
            raise NotFoundError(f"no model at {path} (expected a directory with config.json)")
        try:
            deployment = check_name(name or path.name, "deployment name")
        except ValueError as err:
            raise ValidationError(str(err), hint="pass --name") from err
        weights = path.name if NAME_RE.fullmatch(path.name) else None
        return ResolvedModel(name=deployment, path=path, from_catalog=False, weights=weights)
    try:
        check_name(model, "model name")
    except ValueError as err:
        raise ValidationError(str(err)) from err
    entry = config.models.get(model)
    if entry is None:
        known = ", ".join(sorted(config.models)) or "none"
        raise NotFoundError(
            f"unknown model {model!r}", hint=f"catalog models: {known}; or pass a local path"
        )
    path = _weights(model, entry, config)
    if not _staged(path):
        raise NotFoundError(
            f"weights for {model!r} are not staged at {path}",
            hint="run scripts/make-tiny-model for tiny-llama, or stage the weights there",
        )
    try:
        deployment = check_name(name or model, "deployment name")
    except ValueError as err:
        raise ValidationError(str(err)) from err
    return ResolvedModel(name=deployment, path=path, engine=entry.engine, weights=model)


def _weights(name: str, entry: ModelEntry, config: XhpcConfig) -> Path:
    path = entry.weights_path(config.models_dir)
    if path is not None:
        return path
    if entry.path is None and entry.hf_id is None:
        raise NotFoundError(f"catalog model {name!r} has no path to its weights")
    raise NotFoundError(f"model {name!r} has a relative path but models_dir is not set")


def agent_spec(
    replica_id: str,
    model: ResolvedModel,
    engine: EngineKind,
    config: XhpcConfig,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    engine_config: ModelEngineConfig | None = None,
    **extra: Any,
) -> AgentSpec:
    """What a replica's agent is told: the engine's site settings, the model's engine
    configuration (its argv elements), then ``args`` and ``env``."""
    ecfg = config.engine(engine)
    if engine_config is not None:
        args = (*engine_config.argv(str(model.path)), *args)
        env = {**engine_config.env(), **(env or {})}
    return AgentSpec(
        replica_id=replica_id,
        deployment=model.name,
        engine=engine,
        model_path=str(model.path),
        served_model=model.name,
        python=str(ecfg.python) if ecfg.python else None,
        command=tuple(ecfg.command),
        args=(*ecfg.args, *args),
        env={**ecfg.env, **(env or {})},
        cpu_only=config.cpu_only,
        startup_timeout_s=ecfg.startup_timeout_s,
        heartbeat_interval_s=config.broker.heartbeat_interval_s,
        broker_file=str(broker_file_path(config)),
        stage_dir=str(config.cache.local_dir) if config.cache.local_dir else None,
        weights=model.weights_key,
        **extra,
    )


# -- the site's catalog and the member's own ----------------------------------------------------
# A member's catalog (`xhpc models add`) is read by the member's own CLI and Python API, never by
# the broker: a member's entry reaches the broker as the request it becomes (expand_request: a
# path, a name, an engine, GPUs and engine arguments), admitted as any request. A name in both
# catalogs is the site's (docs/decisions/0020-members-model-catalog.md).

Source = Literal["site", "user"]


class CatalogEntry(BaseModel):
    """One model of `xhpc models list`: its entry and which catalog holds it."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: Source
    entry: ModelEntry
    shadowed: bool = False  # a member's entry hidden by the site's of the same name


def catalog_entries(config: XhpcConfig, user: Mapping[str, ModelEntry]) -> list[CatalogEntry]:
    """Every model of both catalogs by name, the site's first where a name is in both."""
    rows = [CatalogEntry(name=n, source="site", entry=e) for n, e in config.models.items()]
    rows += [
        CatalogEntry(name=n, source="user", entry=e, shadowed=n in config.models)
        for n, e in user.items()
    ]
    return sorted(rows, key=lambda r: (r.name, r.source != "site"))


def shadow_warning(name: str) -> str:
    return (
        f"your catalog's {name!r} is hidden by the site catalog's model of that name; "
        f"`xhpc models rm {name}` and add it under another name"
    )


def find_entry(name: str, config: XhpcConfig, user: Mapping[str, ModelEntry]) -> CatalogEntry:
    """The model ``name`` as `serve` resolves it: the site's, else the member's."""
    rows = [r for r in catalog_entries(config, user) if r.name == name]
    if not rows:
        known = ", ".join(sorted({*config.models, *user})) or "none"
        raise NotFoundError(
            f"unknown model {name!r}", hint=f"catalog models: {known}; or pass a local path"
        )
    return rows[0]


def weights_of(row: CatalogEntry, config: XhpcConfig) -> Path | None:
    """Where ``row``'s weights are looked for (None: nowhere, models_dir being unset)."""
    return row.entry.weights_path(config.models_dir)


def new_user_entry(
    name: str, entry: ModelEntry, config: XhpcConfig, user: Mapping[str, ModelEntry]
) -> ModelEntry:
    """``entry`` checked as a new model ``name`` of the member's catalog (`xhpc models add`)."""
    try:
        check_name(name, "model name")
    except ValueError as err:
        raise ValidationError(str(err)) from err
    if name in config.models:
        raise ValidationError(
            f"model {name!r} is in the site catalog; your catalog may not shadow it",
            hint="pick another name",
        )
    if name in user:
        raise ValidationError(
            f"model {name!r} is already in your catalog", hint=f"`xhpc models rm {name}` first"
        )
    if entry.path is None and entry.hf_id is None:
        raise ValidationError("pass --path (the weights' directory) or --hf-id")
    if entry.path is not None:
        if not entry.path.is_absolute():
            raise ValidationError(f"--path {entry.path} must be an absolute path")
        if not _staged(entry.path):
            raise NotFoundError(f"no model at {entry.path} (expected a directory with config.json)")
    elif config.models_dir is None:
        raise ValidationError(
            "--hf-id without --path needs the site's models_dir (where weights are staged)",
            hint="pass --path",
        )
    return entry


def expand_request(
    req: ServeRequest,
    config: XhpcConfig,
    user: Mapping[str, ModelEntry],
    *,
    gpus_given: bool,
) -> tuple[ServeRequest, str | None]:
    """``req`` with its catalog model's defaults (GPUs unless ``gpus_given``, engine arguments
    before the request's own); a member's model becomes a request for its weights' path, named
    after the entry. Also a warning when the member's entry of that name is hidden."""
    known = NAME_RE.fullmatch(req.model) and (req.model in config.models or req.model in user)
    if _looks_like_path(req.model) or not known:
        return req, None  # a path, or a name for resolve_model (the broker's) to refuse
    row = find_entry(req.model, config, user)
    warning = shadow_warning(row.name) if row.name in config.models and row.name in user else None
    entry = row.entry
    update: dict[str, object] = {}
    if entry.gpus is not None and not gpus_given:
        update["gpus"] = entry.gpus
    layout = entry.layout(req.gpu_type)
    sizes: tuple[str, ...] = ()
    if layout is not None and not gpus_given and req.nodes == 1:
        # The catalog's parallel layout for the GPU type: its nodes, its GPUs on each, and the
        # engine's parallel sizes (before the entry's and the request's own arguments).
        update.update(nodes=layout.nodes, gpus=layout.per_node)
        sizes = layout_engine_args(layout)
    if entry.engine_args or sizes:
        update["engine_args"] = (*sizes, *entry.engine_args, *req.engine_args)
    if entry.engine_config is not None and req.engine_config is None:
        update["engine_config"] = entry.engine_config
    if row.source == "user":
        path = _weights(row.name, entry, config)
        if not _staged(path):
            raise NotFoundError(f"weights for {row.name!r} are not staged at {path}")
        update["model"] = str(path)
        update["name"] = req.name or row.name
        update["engine"] = req.engine or entry.engine
    if not update:
        return req, warning
    return ServeRequest.model_validate({**req.model_dump(), **update}), warning


def _toml_string(value: str) -> str:
    # JSON's string escapes are TOML's, but for DEL, which TOML wants escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: object) -> str:
    """A JSON-shaped value as TOML (tables inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{_toml_string(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    return _toml_string(str(value))


def catalog_toml(entries: Mapping[str, ModelEntry], header: str = "") -> str:
    """A member's catalog as TOML (`[models.NAME]` tables, as in a site file)."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for name in sorted(entries):
        entry = entries[name]
        lines += ["", f"[models.{_toml_string(name)}]"]
        dumped = entry.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
        for key, value in dumped.items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"
