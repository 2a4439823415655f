"""A fresh shell after the quickstart: `eval "$(scripts/dev-cluster env)"` puts `xhpc` on PATH and
sets what the README's commands and Slurm's own need, without touching the cluster; the README
and the quickstart say to run it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
EVAL = 'eval "$(scripts/dev-cluster env)"'


def _shell(script: str) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_dev_cluster_env_puts_xhpc_on_path_and_names_the_configs() -> None:
    xhpc, site, slurm_conf, path = _shell(
        f'{EVAL}; {EVAL}; command -v xhpc; echo "$XHPC_SITE_CONFIG"; echo "$SLURM_CONF"; '
        'echo "$PATH"'
    )
    assert xhpc == str(ROOT / ".venv" / "bin" / "xhpc")
    assert site == str(ROOT / "site-configs" / "dev-cluster.toml") and Path(site).is_file()
    assert slurm_conf.endswith("/etc/slurm.conf")  # what squeue and sinfo read
    assert path == f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin"  # twice: added once


def test_the_readme_and_the_quickstart_say_to_set_up_the_shell() -> None:
    readme = (ROOT / "README.md").read_text()
    using = readme.split("## Using it", 1)[1].split("```bash\n", 1)[1]
    assert using.startswith(EVAL), "the commands of 'Using it' need the shell set up first"
    assert "squeue" in using.split("\n\n", 1)[0]
    assert EVAL in (ROOT / "scripts" / "quickstart").read_text()
