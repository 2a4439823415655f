"""The model catalog: a name or a local path becomes a typed, resolved model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import AgentSpec, EngineKind, check_name
from xhpc.paths import broker_file_path
from xhpc.settings import XhpcConfig


class ResolvedModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    path: Path
    engine: EngineKind | None = None
    from_catalog: bool = True


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
        path = Path(model).expanduser().resolve()
        if not _staged(path):
            raise NotFoundError(f"no model at {path} (expected a directory with config.json)")
        try:
            deployment = check_name(name or path.name, "deployment name")
        except ValueError as err:
            raise ValidationError(str(err), hint="pass --name") from err
        return ResolvedModel(name=deployment, path=path, from_catalog=False)
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
    if entry.path is None:
        raise NotFoundError(f"catalog model {model!r} has no path to its weights")
    path = entry.path
    if not path.is_absolute():
        if config.models_dir is None:
            raise NotFoundError(f"model {model!r} has a relative path but models_dir is not set")
        path = config.models_dir / path
    if not _staged(path):
        raise NotFoundError(
            f"weights for {model!r} are not staged at {path}",
            hint="run scripts/make-tiny-model for tiny-llama, or stage the weights there",
        )
    try:
        deployment = check_name(name or model, "deployment name")
    except ValueError as err:
        raise ValidationError(str(err)) from err
    return ResolvedModel(name=deployment, path=path, engine=entry.engine)


def agent_spec(
    replica_id: str,
    model: ResolvedModel,
    engine: EngineKind,
    config: XhpcConfig,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **extra: Any,
) -> AgentSpec:
    """What a replica's agent is told: the engine's site settings, then ``args`` and ``env``."""
    ecfg = config.engine(engine)
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
        **extra,
    )
