"""Layered config loading and the model catalog (hostile names are refused before anything runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xhpc.catalog import agent_spec, resolve_model
from xhpc.config import ENV_FILES, ENV_KEYS, PACKAGED_DEFAULTS, XhpcConfig, load_config
from xhpc.errors import ConfigError, NotFoundError, ValidationError
from xhpc.models import EngineKind


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with no XHPC_* variables and no user config file."""
    return {"XDG_CONFIG_HOME": str(tmp_path / "no-user-config")}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- config ---------------------------------------------------------------------------------------
def test_packaged_defaults_only(env: dict[str, str]) -> None:
    config, sources = load_config(env=env)
    assert sources == [str(PACKAGED_DEFAULTS)]
    assert config.site == "default"
    assert config.default_engine is EngineKind.VLLM
    assert config.slurm.default_time == "01:00:00"
    assert "tiny-llama" in config.models


def test_layers_later_wins(tmp_path: Path, env: dict[str, str]) -> None:
    site = write(
        tmp_path / "site" / "site.toml",
        'site = "s"\n[slurm]\npartition = "p-site"\ndefault_time = "02:00:00"\n'
        "[proxy]\nport = 9001\n",
    )
    user = write(tmp_path / "user.toml", '[slurm]\npartition = "p-user"\n')
    env.update(XHPC_USER_CONFIG=str(user), XHPC_PARTITION="p-env", XHPC_PROXY_PORT="9002")
    config, sources = load_config(site, env=env)
    assert config.slurm.partition == "p-env"
    assert config.proxy.port == 9002
    assert config.slurm.default_time == "02:00:00"  # from the site file, untouched above it
    assert config.site == "s"
    assert sources == [str(PACKAGED_DEFAULTS), str(site), str(user), "environment"]
    config, sources = load_config(site, overrides={"slurm": {"partition": "p-cli"}}, env=env)
    assert config.slurm.partition == "p-cli"
    assert config.proxy.port == 9002
    assert sources[-1] == "command line"


def test_site_file_from_env(tmp_path: Path, env: dict[str, str]) -> None:
    site = write(tmp_path / "s.toml", "cpu_only = true\n")
    env["XHPC_SITE_CONFIG"] = str(site)
    config, sources = load_config(env=env)
    assert config.cpu_only is True
    assert str(site) in sources


def test_relative_paths_resolve_against_the_files_dir(tmp_path: Path, env: dict[str, str]) -> None:
    site = write(
        tmp_path / "conf" / "site.toml",
        'state_dir = "state"\nmodels_dir = "../models"\n'
        '[slurm]\nconf_path = "/etc/slurm/slurm.conf"\n'
        '[engines.vllm]\npython = "envs/vllm/bin/python"\n',
    )
    config, _ = load_config(site, env=env)
    assert config.state_dir == tmp_path / "conf" / "state"
    assert config.models_dir == tmp_path / "models"
    assert config.slurm.conf_path == Path("/etc/slurm/slurm.conf")
    assert config.engine(EngineKind.VLLM).python == tmp_path / "conf" / "envs/vllm/bin/python"
    assert config.resolved_db_path == tmp_path / "conf" / "state" / "xhpc.db"


def test_env_state_dir(tmp_path: Path, env: dict[str, str]) -> None:
    env["XHPC_STATE_DIR"] = str(tmp_path / "st")
    config, _ = load_config(env=env)
    assert config.resolved_state_dir == tmp_path / "st"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("bogus = 1\n", "bogus"),
        ("[slurm]\nparttion = 'gpu'\n", "slurm.parttion"),
        ("[engines.vllm]\npyhton = '/x'\n", "engines.vllm.pyhton"),
        ("[models.m]\npath = 'm'\nsize = 3\n", "models.m.size"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, env: dict[str, str], text: str, where: str) -> None:
    site = write(tmp_path / "site.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(site, env=env)
    assert where in info.value.message
    assert "unknown key" in info.value.message
    assert str(site) in (info.value.hint or "")


def test_wrong_type_is_a_config_error(tmp_path: Path, env: dict[str, str]) -> None:
    site = write(tmp_path / "site.toml", '[proxy]\nport = "eighty"\n')
    with pytest.raises(ConfigError, match=r"proxy\.port"):
        load_config(site, env=env)


def test_unknown_env_var_lists_valid_ones(env: dict[str, str]) -> None:
    env["XHPC_STATEDIR"] = "/tmp/x"
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    msg = info.value.message
    assert "XHPC_STATEDIR" in msg
    for valid in (*ENV_KEYS, *ENV_FILES):
        assert valid in msg


def test_invalid_toml(tmp_path: Path, env: dict[str, str]) -> None:
    site = write(tmp_path / "site.toml", "[slurm\npartition = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(site, env=env)


def test_missing_site_file(tmp_path: Path, env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", env=env)


# -- catalog --------------------------------------------------------------------------------------
def model_dir(path: Path) -> Path:
    write(path / "config.json", "{}")
    return path


def test_unknown_model(env: dict[str, str]) -> None:
    config, _ = load_config(env=env)
    with pytest.raises(NotFoundError, match="unknown model 'nope'") as info:
        resolve_model("nope", config)
    assert "tiny-llama" in (info.value.hint or "")


@pytest.mark.parametrize(
    "model",
    [
        "a'b",
        'a"b',
        "a\nb",
        "a;b",
        "x/../y",
        "tiny-llama/../../etc",
        "$(id)",
        "a b",
        "-rf",
        "a\x1bb",
        "",
    ],
)
def test_hostile_model_names(model: str) -> None:
    with pytest.raises(ValidationError):
        resolve_model(model, XhpcConfig())


@pytest.mark.parametrize("name", ["../evil", "a;b", "a'b", "a\nb", "x" * 64])
def test_hostile_deployment_names(tmp_path: Path, name: str) -> None:
    path = model_dir(tmp_path / "m")
    with pytest.raises(ValidationError):
        resolve_model(str(path), XhpcConfig(), name=name)


def test_local_path_without_config_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match=r"config\.json"):
        resolve_model("./empty", XhpcConfig())
    with pytest.raises(NotFoundError, match=r"config\.json"):
        resolve_model("../nowhere", XhpcConfig())


def test_local_path_with_config_json(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "my-model")
    resolved = resolve_model(str(path), XhpcConfig())
    assert (resolved.name, resolved.path, resolved.from_catalog) == ("my-model", path, False)
    assert resolve_model(str(path), XhpcConfig(), name="other").name == "other"


def test_local_path_with_hostile_dir_name_needs_name(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "we ird;name")
    with pytest.raises(ValidationError) as info:
        resolve_model(str(path), XhpcConfig())
    assert info.value.hint == "pass --name"
    assert resolve_model(str(path), XhpcConfig(), name="ok").path == path


def test_catalog_model_staged_under_models_dir(tmp_path: Path, env: dict[str, str]) -> None:
    env["XHPC_MODELS_DIR"] = str(tmp_path)
    config, _ = load_config(env=env)
    with pytest.raises(NotFoundError, match="not staged"):
        resolve_model("tiny-llama", config)
    model_dir(tmp_path / "tiny-llama")
    resolved = resolve_model("tiny-llama", config)
    assert (resolved.name, resolved.path, resolved.from_catalog) == (
        "tiny-llama",
        tmp_path / "tiny-llama",
        True,
    )


def test_catalog_model_without_models_dir(env: dict[str, str]) -> None:
    config, _ = load_config(env=env)
    with pytest.raises(NotFoundError, match="models_dir"):
        resolve_model("tiny-llama", config)


def test_a_model_the_caller_may_not_read_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m").mkdir()

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.raises(ValidationError, match=r"cannot read the model at .*: permission denied"):
        resolve_model(str(tmp_path / "m"), XhpcConfig())


def test_the_weights_cache_knows_weights_by_their_name_not_the_deployments(
    tmp_path: Path,
) -> None:
    """Two deployments of one model share one node-local copy and one placement preference:
    a catalog model's copies go by its catalog name, a served directory's by its own name."""
    models = tmp_path / "models"
    model_dir(models / "tiny-llama")
    config = XhpcConfig.model_validate(
        {"models_dir": str(models), "models": {"tiny-llama": {"path": "tiny-llama"}}}
    )
    for name in ("first", "second"):
        resolved = resolve_model("tiny-llama", config, name=name)
        assert (resolved.name, resolved.weights_key) == (name, "tiny-llama")
        spec = agent_spec(f"{name}-0", resolved, EngineKind.COMMAND, config)
        assert (spec.deployment, spec.weights) == (name, "tiny-llama")
    served = resolve_model(str(model_dir(tmp_path / "my-weights")), config, name="mine")
    assert (served.name, served.weights_key) == ("mine", "my-weights")
