"""Every number a site config sets is range-checked, and `xhpc config check` lists every
problem of a config, one line each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.conftest import Run
from xhpc.config import PACKAGED_DEFAULTS, load_config
from xhpc.errors import ConfigError

pytestmark = pytest.mark.security

ROOT = Path(__file__).resolve().parents[2]
SITE_CONFIGS = sorted((ROOT / "site-configs").glob("*.toml"))

BAD = [
    ("broker", "reconcile_interval_s", "0"),
    ("broker", "heartbeat_interval_s", "-1"),
    ("broker", "heartbeat_timeout_s", "0"),
    ("broker", "drain_timeout_s", "-5"),
    ("broker", "agent_port", "99999"),
    ("broker", "agent_port", "-1"),
    ("broker", "pilot_poll_s", "0"),
    ("slurm", "command_timeout_s", "-1"),
    ("slurm", "command_timeout_s", "0"),
    ("slurm", "cpus_per_replica", "0"),
    ("slurm", "mem_per_replica_mb", "0"),
    ("proxy", "port", "99999"),
    ("proxy", "port", "-1"),
    ("proxy", "refresh_interval_s", "0"),
    ("proxy", "upstream_timeout_s", "-1"),
    ("proxy", "workers", "0"),
    ("placement", "reservation_timeout_s", "0"),
    ("placement", "probe_ttl_s", "-1"),
    ("placement", "max_view_age_s", "-1"),
    ("placement", "replan_after_s", "0"),
    ("placement", "max_replans", "-1"),
    ("probe", "interval_s", "0"),
    ("lifecycle", "crash_loop_starts", "0"),
    ("engines.vllm", "startup_timeout_s", "0"),
    ("broker", "reconcile_interval_s", "nan"),
    ("proxy", "upstream_timeout_s", "inf"),
]


def _site(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("section", "key", "value"), BAD)
def test_an_out_of_range_number_is_a_config_error(
    tmp_path: Path, section: str, key: str, value: str
) -> None:
    site = _site(tmp_path, f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"invalid config at {section}\.{key}:"):
        load_config(site, env={"XDG_CONFIG_HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("broker", "agent_port", "0"),  # 0: any free port
        ("proxy", "port", "0"),
        ("proxy", "port", "65535"),
        ("broker", "drain_timeout_s", "0"),  # cancel at once
        ("placement", "max_view_age_s", "0"),  # always a fresh view
        ("placement", "max_replans", "0"),
        ("broker", "reconcile_interval_s", "0.05"),
    ],
)
def test_edge_values_that_mean_something_are_accepted(
    tmp_path: Path, section: str, key: str, value: str
) -> None:
    load_config(_site(tmp_path, f"[{section}]\n{key} = {value}\n"), env={})


@pytest.mark.parametrize("path", [PACKAGED_DEFAULTS, *SITE_CONFIGS], ids=lambda p: p.name)
def test_the_packaged_defaults_and_every_site_config_validate(path: Path, tmp_path: Path) -> None:
    config, _ = load_config(path, env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert config.broker.reconcile_interval_s > 0


# -- xhpc config check ----------------------------------------------------------------------------


BAD_SITE = """
[broker]
reconcile_interval_s = 0
agent_port = 99999
nope = 1

[proxy]
port = 70000
upstream_timeout_s = -3
"""


def test_config_check_says_ok_for_a_good_config(xhpc: Run, tmp_path: Path) -> None:
    result = xhpc("config", "check", str(_site(tmp_path, "[broker]\nreconcile_interval_s = 2\n")))
    assert (result.code, result.out) == (0, "ok\n")


def test_config_check_lists_every_problem_one_line_each(xhpc: Run, tmp_path: Path) -> None:
    result = xhpc("config", "check", str(_site(tmp_path, BAD_SITE)))
    assert result.code == 2
    lines = result.out.splitlines()
    assert len(lines) == 5
    assert {line.split(":", 1)[0] for line in lines} == {
        "broker.reconcile_interval_s",
        "broker.agent_port",
        "broker.nope",
        "proxy.port",
        "proxy.upstream_timeout_s",
    }
    assert any("greater than 0" in line for line in lines)
    assert any("valid keys:" in line and "reconcile_interval_s" in line for line in lines)
    assert "site.toml" in result.err  # the sources it read


def test_config_check_reads_the_site_config_as_every_command_does(
    xhpc: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = str(_site(tmp_path, BAD_SITE))
    assert xhpc("--site", site, "config", "check").code == 2
    monkeypatch.setenv("XHPC_SITE_CONFIG", site)
    result = xhpc("config", "check")
    assert result.code == 2 and "proxy.port" in result.out
    # Other commands still stop at the first problem, with one `error:` line.
    shown = xhpc("config", "show")
    assert shown.code == 2 and shown.err.startswith("error: invalid config at")
    monkeypatch.setenv("XHPC_PROXY_PORT", "0")
    monkeypatch.delenv("XHPC_SITE_CONFIG")
    assert xhpc("config", "check").out == "ok\n"


def test_config_check_of_a_missing_or_broken_file(xhpc: Run, tmp_path: Path) -> None:
    missing = xhpc("config", "check", str(tmp_path / "nope.toml"))
    assert missing.code == 2 and "not found" in missing.out
    broken = xhpc("config", "check", str(_site(tmp_path, "[broker\n")))
    assert broken.code == 2 and "not valid TOML" in broken.out
    assert len(broken.out.splitlines()) == 1
