"""Configuration: models and the one loader of config files and XHPC_* environment variables.

Layers, later wins: packaged defaults -> site file -> user file -> XHPC_* env -> CLI overrides.
Relative paths in a file are resolved against that file's directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xhpc.errors import ConfigError, plain_message

# The config's models are pydantic (xhpc.settings): imported when a config is validated, not with
# this module, so that `xhpc ps` finds the broker's socket without building them
# (locate_state_dir; docs/performance.md). The names below stay importable from here.
if TYPE_CHECKING:
    from xhpc.settings import (
        BrokerConfig,
        EngineConfig,
        ModelEntry,
        PlacementConfig,
        ProxyConfig,
        Section,
        SlurmConfig,
        XhpcConfig,
    )

__all__ = [
    "BrokerConfig",
    "EngineConfig",
    "ModelEntry",
    "PlacementConfig",
    "ProxyConfig",
    "Section",
    "SlurmConfig",
    "XhpcConfig",
    "load_config",
    "load_user_catalog",
    "locate_state_dir",
    "save_user_catalog",
    "user_catalog_path",
]


def __getattr__(name: str) -> object:
    """The settings' models named in __all__, imported on first use."""
    if name in __all__:
        import xhpc.settings

        return getattr(xhpc.settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PACKAGED_DEFAULTS = Path(__file__).parent / "data" / "defaults.toml"
# A worked example of a GPU site's file, shipped in the wheel (`xhpc config example`).
SITE_EXAMPLE = Path(__file__).parent / "data" / "site.example.toml"


def site_example() -> str:
    """The packaged example of a site file, as text."""
    return SITE_EXAMPLE.read_text()


_PATH_KEYS = {
    "state_dir",
    "db_path",
    "models_dir",
    "conf_path",
    "bin_dir",
    "python",
    "fake_file",
    "proc_root",
    "broker_file",
    "token_file",
    "local_dir",
}


def _resolve_paths(data: Any, base: Path) -> Any:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key in _PATH_KEYS and isinstance(value, str):
                p = Path(os.path.expanduser(value))
                out[key] = os.path.normpath(p if p.is_absolute() else base.absolute() / p)
            else:
                out[key] = _resolve_paths(value, base)
        return out
    return data


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from err
    resolved: dict[str, Any] = _resolve_paths(data, path.parent)
    return resolved


ENV_KEYS = {
    "XHPC_STATE_DIR": ("state_dir",),
    "XHPC_DB_PATH": ("db_path",),
    "XHPC_MODELS_DIR": ("models_dir",),
    "XHPC_PROXY_PORT": ("proxy", "port"),
    "XHPC_PROXY_HOST": ("proxy", "host"),
    "XHPC_PARTITION": ("slurm", "partition"),
}
ENV_FILES = ("XHPC_SITE_CONFIG", "XHPC_USER_CONFIG", "XHPC_CONFIG")
# Read on a laptop by `xhpc --remote` (remote_xhpc_env): which xhpc the login node runs.
REMOTE_XHPC_ENV = "XHPC_REMOTE_XHPC"
# Read by scripts/ (dev cluster, engine setup, model builder, the test run), not by xhpc itself.
SCRIPT_ENV = frozenset(
    {
        "XHPC_TEST_SHARED_ENGINES",
        "XHPC_TEST_WHEEL_VENV",
        "XHPC_DEV_DIR",
        "XHPC_DEV_GPUS",
        "XHPC_DEV_NODES",
        "XHPC_DEV_PORT",
        "XHPC_GEN_SHA",
        "XHPC_PYTHON",
        "XHPC_TF_PYTHON",
        "XHPC_VENVS_DIR",
    }
)


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    unknown = sorted(
        k
        for k in env
        if k.startswith("XHPC_")
        and k not in ENV_KEYS
        and k not in ENV_FILES
        and k not in SCRIPT_ENV
        and k != REMOTE_XHPC_ENV
    )
    layer: dict[str, Any] = {}
    for key, path in ENV_KEYS.items():
        if key in env:
            node = layer
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = env[key]
    if unknown:
        valid = ", ".join(sorted([*ENV_KEYS, *ENV_FILES, REMOTE_XHPC_ENV]))
        raise ConfigError(f"unknown environment variable(s) {', '.join(unknown)}; valid: {valid}")
    return layer


def remote_xhpc_env(env: Mapping[str, str] | None = None) -> str | None:
    """``$XHPC_REMOTE_XHPC``: the xhpc command `xhpc --remote` runs on the login node (unset or
    empty: none given)."""
    value = (os.environ if env is None else env).get(REMOTE_XHPC_ENV, "")
    return value or None


def valid_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The field names allowed at ``loc`` (a path into XhpcConfig), for error messages."""
    from pydantic import BaseModel

    from xhpc.settings import XhpcConfig

    model: type[BaseModel] = XhpcConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        # A section (a model) or a table of sections (dict[..., Model]); other parts are dict keys.
        candidates = (annotation, *getattr(annotation, "__args__", ()))
        nested = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            model = nested[-1]
    return sorted(model.model_fields)


def site_file_of(site_file: Path | None, env: Mapping[str, str] | None = None) -> Path | None:
    """The site config file in use: ``site_file`` (``--site``), else $XHPC_SITE_CONFIG; None:
    no site config was given."""
    env = os.environ if env is None else env
    return site_file or (Path(env["XHPC_SITE_CONFIG"]) if env.get("XHPC_SITE_CONFIG") else None)


def user_config_path(env: Mapping[str, str]) -> Path:
    """The user's config file: $XHPC_USER_CONFIG, else $XDG_CONFIG_HOME/xhpc/config.toml."""
    user = env.get("XHPC_USER_CONFIG")
    if user:
        return Path(user)
    return Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "xhpc" / "config.toml"


def _layers(site_file: Path | None, env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The files and variables of the layered config merged, not validated, and their names."""
    sources: list[str] = []
    data: dict[str, Any] = {}
    layers: list[Path] = [PACKAGED_DEFAULTS]
    site = site_file_of(site_file, env)
    if site is not None:
        layers.append(site)
    user = env.get("XHPC_USER_CONFIG")
    user_path = user_config_path(env)
    if user or user_path.exists():
        layers.append(user_path)
    for path in layers:
        data = _merge(data, read_toml(path))
        sources.append(str(path))
    env_layer = _env_layer(env)
    if env_layer:
        data = _merge(data, _resolve_paths(env_layer, Path.cwd()))
        sources.append("environment")
    return data, sources


def load_config(
    site_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[XhpcConfig, list[str]]:
    """Load the layered config; returns it and the list of sources used, in order."""
    from pydantic import ValidationError as PydanticValidationError

    from xhpc.settings import XhpcConfig

    data, sources = _layers(site_file, os.environ if env is None else env)
    if overrides:
        data = _merge(data, overrides)
        sources.append("command line")
    try:
        return XhpcConfig.model_validate(data), sources
    except PydanticValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = plain_message(first["msg"])
        if first["type"] == "extra_forbidden":
            msg = f"unknown key; valid keys: {', '.join(valid_keys(first['loc'][:-1]))}"
        raise ConfigError(
            f"invalid config at {where}: {msg}", hint=f"sources: {', '.join(sources)}"
        ) from err


def locate_state_dir(site_file: Path | None = None) -> Path:
    """``load_config(site_file)[0].resolved_state_dir`` from the same layers (files, XHPC_*
    variables, their errors), reading ``state_dir`` alone: what a command that only calls the
    broker needs to find its socket, without validating the rest of the config (the pydantic
    models cost more than the whole of `xhpc ps` may take; docs/performance.md). A
    ``state_dir`` that is not a path string is left to load_config, which refuses it."""
    data, _ = _layers(site_file, os.environ)
    value = data.get("state_dir")
    if isinstance(value, str):
        return Path(value)
    if value is not None:
        return load_config(site_file)[0].resolved_state_dir
    # as XhpcConfig.resolved_state_dir (tests/unit/test_settings_state_dir.py holds them equal)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "xhpc"


# -- the member's own model catalog (`xhpc models`) ---------------------------------------------
USER_CATALOG_HEADER = """Your own models (`xhpc models add | rm`); `xhpc serve NAME` finds them
next to the site's. Written by xhpc (owner-only); one [models.NAME] table per model."""


def user_catalog_path(env: Mapping[str, str] | None = None) -> Path:
    """The member's own model catalog: ``models.toml`` next to the user's config file
    (``~/.config/xhpc/models.toml``, or in $XHPC_USER_CONFIG's directory)."""
    return user_config_path(os.environ if env is None else env).parent / "models.toml"


def load_user_catalog(env: Mapping[str, str] | None = None) -> dict[str, ModelEntry]:
    """The member's own models by name (none when the file does not exist)."""
    from pydantic import ValidationError as PydanticValidationError

    from xhpc.models import check_name
    from xhpc.settings import ModelEntry

    path = user_catalog_path(env)
    if not path.exists():
        return {}
    data = read_toml(path)
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: models")
    tables = data.get("models", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: models must be a table of [models.NAME] tables")
    out: dict[str, ModelEntry] = {}
    for name, raw in tables.items():
        try:
            check_name(name, "model name")
            out[name] = ModelEntry.model_validate(raw)
        except PydanticValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "entry"
            msg = first["msg"]
            if first["type"] == "extra_forbidden":
                msg = f"unknown key; valid keys: {', '.join(sorted(ModelEntry.model_fields))}"
            raise ConfigError(f"{path}: model {name!r}, {where}: {msg}") from err
        except ValueError as err:
            raise ConfigError(f"{path}: {err}") from err
    return out


def save_user_catalog(
    entries: Mapping[str, ModelEntry], env: Mapping[str, str] | None = None
) -> Path:
    """Write the member's catalog whole: a private temporary file (0600) renamed over the old
    one, so a reader sees the old catalog or the new one, never a part."""
    from xhpc.catalog import catalog_toml

    path = user_catalog_path(env)
    text = catalog_toml(entries, USER_CATALOG_HEADER)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".models.", suffix=".tmp")
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror or err}") from err
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
