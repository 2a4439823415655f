"""Configuration: models and the one loader of config files and XHPC_* environment variables.

Layers, later wins: packaged defaults -> site file -> user file -> XHPC_* env -> CLI overrides.
Relative paths in a file are resolved against that file's directory.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from xhpc.errors import ConfigError
from xhpc.models import EngineKind

PACKAGED_DEFAULTS = Path(__file__).parent / "data" / "defaults.toml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlurmConfig(Section):
    conf_path: Path | None = None  # exported as SLURM_CONF to every Slurm command
    bin_dir: Path | None = None
    partition: str | None = None
    default_time: str = "01:00:00"
    account: str | None = None
    command_timeout_s: float = 30.0
    cpus_per_replica: int = 1
    mem_per_replica_mb: int | None = None


class BrokerConfig(Section):
    agent_bind: str = "0.0.0.0"
    agent_port: int = 0
    advertise_host: str | None = None  # the address compute nodes use to reach the broker
    reconcile_interval_s: float = 1.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 20.0


class ProxyConfig(Section):
    host: str = "127.0.0.1"
    port: int = 8000
    refresh_interval_s: float = 1.0
    upstream_timeout_s: float = 600.0


class EngineConfig(Section):
    python: Path | None = None  # the engine's own Python environment
    command: list[str] = Field(default_factory=list)  # for the `command` engine
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = 600.0


class ModelEntry(Section):
    path: Path | None = None  # relative paths are under models_dir
    hf_id: str | None = None
    engine: EngineKind | None = None
    description: str = ""


class XhpcConfig(Section):
    site: str = "default"
    state_dir: Path | None = None
    db_path: Path | None = None
    models_dir: Path | None = None
    cpu_only: bool = False
    default_engine: EngineKind = EngineKind.VLLM
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    engines: dict[EngineKind, EngineConfig] = Field(default_factory=dict)
    models: dict[str, ModelEntry] = Field(default_factory=dict)

    @property
    def resolved_state_dir(self) -> Path:
        if self.state_dir is not None:
            return self.state_dir
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "xhpc"

    @property
    def resolved_db_path(self) -> Path:
        return self.db_path or self.resolved_state_dir / "xhpc.db"

    def engine(self, kind: EngineKind) -> EngineConfig:
        return self.engines.get(kind, EngineConfig())


_PATH_KEYS = {"state_dir", "db_path", "models_dir", "conf_path", "bin_dir", "python"}


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
    return _resolve_paths(data, path.parent)


ENV_KEYS = {
    "XHPC_STATE_DIR": ("state_dir",),
    "XHPC_DB_PATH": ("db_path",),
    "XHPC_MODELS_DIR": ("models_dir",),
    "XHPC_PROXY_PORT": ("proxy", "port"),
    "XHPC_PROXY_HOST": ("proxy", "host"),
    "XHPC_PARTITION": ("slurm", "partition"),
}
ENV_FILES = ("XHPC_SITE_CONFIG", "XHPC_USER_CONFIG", "XHPC_CONFIG")
# Read by scripts/ (dev cluster, engine setup, model builder), not by xhpc itself.
SCRIPT_ENV = frozenset({
    "XHPC_DEV_DIR", "XHPC_DEV_GPUS", "XHPC_DEV_NODES", "XHPC_DEV_PORT", "XHPC_GEN_SHA",
    "XHPC_PYTHON", "XHPC_TF_PYTHON", "XHPC_VENVS_DIR",
})


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    unknown = sorted(
        k for k in env
        if k.startswith("XHPC_") and k not in ENV_KEYS and k not in ENV_FILES
        and k not in SCRIPT_ENV
    )
    layer: dict[str, Any] = {}
    for key, path in ENV_KEYS.items():
        if key in env:
            node = layer
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = env[key]
    if unknown:
        valid = ", ".join(sorted([*ENV_KEYS, *ENV_FILES]))
        raise ConfigError(f"unknown environment variable(s) {', '.join(unknown)}; valid: {valid}")
    return layer


def _valid_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The field names allowed at ``loc`` (a path into XhpcConfig), for error messages."""
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


def load_config(
    site_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[XhpcConfig, list[str]]:
    """Load the layered config; returns it and the list of sources used, in order."""
    env = os.environ if env is None else env
    sources: list[str] = []
    data: dict[str, Any] = {}
    layers: list[Path] = [PACKAGED_DEFAULTS]
    site = site_file or (Path(env["XHPC_SITE_CONFIG"]) if env.get("XHPC_SITE_CONFIG") else None)
    if site is not None:
        layers.append(site)
    user = env.get("XHPC_USER_CONFIG")
    user_path = (
        Path(user)
        if user
        else Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "xhpc" / "config.toml"
    )
    if user or user_path.exists():
        layers.append(user_path)
    for path in layers:
        data = _merge(data, read_toml(path))
        sources.append(str(path))
    env_layer = _env_layer(env)
    if env_layer:
        data = _merge(data, _resolve_paths(env_layer, Path.cwd()))
        sources.append("environment")
    if overrides:
        data = _merge(data, overrides)
        sources.append("command line")
    try:
        return XhpcConfig.model_validate(data), sources
    except PydanticValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = f"unknown key; valid keys: {', '.join(_valid_keys(first['loc'][:-1]))}"
        raise ConfigError(
            f"invalid config at {where}: {msg}", hint=f"sources: {', '.join(sources)}"
        ) from err
