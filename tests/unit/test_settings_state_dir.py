"""`xhpc ps` finds the broker's socket with xhpc.config.locate_state_dir, which reads the config's
layers but validates only `state_dir`: it names the same directory as the whole validated config
(`load_config()[0].resolved_state_dir`) for every way of setting it, and fails alike where the
layers themselves are wrong."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from xhpc.config import load_config, locate_state_dir
from xhpc.errors import ConfigError


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No XHPC_* or XDG_* variables; HOME and the working directory in tmp_path."""
    for key in list(os.environ):
        if key.startswith(("XHPC_", "XDG_")):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    return home


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def same(site: Path | None = None) -> Path:
    full = load_config(site)[0].resolved_state_dir
    assert locate_state_dir(site) == full
    return full


Setup = Callable[[Path, pytest.MonkeyPatch], Path | None]  # returns the --site file, if any


def _nothing(home: Path, mp: pytest.MonkeyPatch) -> None:
    return None


def _xdg_state_home(home: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("XDG_STATE_HOME", str(home / "xdg-state"))


def _empty_xdg_state_home(home: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("XDG_STATE_HOME", "")


def _env_absolute(home: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("XHPC_STATE_DIR", str(home / "from-env"))


def _env_relative(home: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("XHPC_STATE_DIR", "rel/../state")  # against the working directory


def _env_tilde(home: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("XHPC_STATE_DIR", "~/tilde-state")


def _site_option(home: Path, mp: pytest.MonkeyPatch) -> Path:
    return write(home / "site" / "site.toml", 'state_dir = "state"\n')  # against the file's dir


def _site_env(home: Path, mp: pytest.MonkeyPatch) -> None:
    site = write(home / "site" / "site.toml", 'state_dir = "/srv/xhpc/state"\n')
    mp.setenv("XHPC_SITE_CONFIG", str(site))


def _option_over_env_site(home: Path, mp: pytest.MonkeyPatch) -> Path:
    _site_env(home, mp)
    return write(home / "other.toml", 'state_dir = "~/other"\n')


def _user_file(home: Path, mp: pytest.MonkeyPatch) -> None:
    write(home / ".config" / "xhpc" / "config.toml", 'state_dir = "mine"\n')


def _user_over_site(home: Path, mp: pytest.MonkeyPatch) -> None:
    _site_env(home, mp)
    mp.setenv("XDG_CONFIG_HOME", str(home / "cfg"))
    write(home / "cfg" / "xhpc" / "config.toml", 'site = "x"\nstate_dir = "/u/state"\n')


def _user_config_var(home: Path, mp: pytest.MonkeyPatch) -> None:
    user = write(home / "elsewhere" / "u.toml", '[slurm]\npartition = "p"\n')  # no state_dir
    mp.setenv("XHPC_USER_CONFIG", str(user))
    _site_env(home, mp)


def _env_over_files(home: Path, mp: pytest.MonkeyPatch) -> Path:
    _user_over_site(home, mp)
    mp.setenv("XHPC_STATE_DIR", "/from/env")
    return _site_option(home, mp)


def _other_keys_only(home: Path, mp: pytest.MonkeyPatch) -> Path:
    mp.setenv("XHPC_PROXY_PORT", "9000")
    mp.setenv("XDG_STATE_HOME", str(home / "s"))
    return write(home / "site.toml", '[broker]\nadmins = ["a"]\n')


@pytest.mark.parametrize(
    "setup",
    [
        _nothing, _xdg_state_home, _empty_xdg_state_home, _env_absolute, _env_relative,
        _env_tilde, _site_option, _site_env, _option_over_env_site, _user_file,
        _user_over_site, _user_config_var, _env_over_files, _other_keys_only,
    ],
)  # fmt: skip
def test_the_same_state_dir_as_the_whole_config(
    home: Path, monkeypatch: pytest.MonkeyPatch, setup: Setup
) -> None:
    same(setup(home, monkeypatch))


def test_the_answers_themselves(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert same() == home / ".local" / "state" / "xhpc"
    assert same(_site_option(home, monkeypatch)) == home / "site" / "state"
    _env_over_files(home, monkeypatch)
    assert same(_site_option(home, monkeypatch)) == Path("/from/env")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda home, mp: mp.setenv("XHPC_PORT", "1"), "XHPC_PORT"),  # unknown variable
        (lambda home, mp: home / "missing.toml", "not found"),
        (lambda home, mp: write(home / "bad.toml", "state_dir = \n"), "not valid TOML"),
        (lambda home, mp: write(home / "int.toml", "state_dir = 5\n"), "state_dir"),
        (lambda home, mp: write(home / "t.toml", "[state_dir]\na = 1\n"), "state_dir"),
    ],
)
def test_both_refuse_the_same_layers(
    home: Path, monkeypatch: pytest.MonkeyPatch, setup: Setup, message: str
) -> None:
    site = setup(home, monkeypatch)
    with pytest.raises(ConfigError, match=message) as full:
        load_config(site)
    with pytest.raises(ConfigError, match=message) as located:
        locate_state_dir(site)
    assert located.value.one_line() == full.value.one_line()


def test_the_rest_of_the_config_is_not_validated(home: Path) -> None:
    """What locate_state_dir leaves to the commands that load the config (and `xhpc config
    check`): a value that is wrong elsewhere does not stop `xhpc ps` from finding the broker."""
    site = write(home / "site.toml", 'state_dir = "/s"\n[proxy]\nport = -1\nnope = 1\n')
    with pytest.raises(ConfigError, match="proxy"):
        load_config(site)
    assert locate_state_dir(site) == Path("/s")
