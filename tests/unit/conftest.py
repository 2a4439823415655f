"""Fixtures for the unit and component tests: captured Slurm output, parsed nodes, clean env."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from xhpc.cli.main import main
from xhpc.models import NodeInfo
from xhpc.slurm.parse import parse_sinfo_json

DATA = Path(__file__).resolve().parent.parent / "data"


def _read_slurm(name: str) -> str:
    return (DATA / "slurm" / name).read_text()


@pytest.fixture
def slurm_output() -> Callable[[str], str]:
    """Output captured from the real dev cluster (see tests/data/slurm/README.md), by file name."""
    return _read_slurm


@pytest.fixture
def golden_dir() -> Path:
    return DATA / "golden"


@pytest.fixture
def idle_nodes() -> list[NodeInfo]:
    return parse_sinfo_json(_read_slurm("sinfo-idle.json"))


@pytest.fixture
def busy_nodes() -> list[NodeInfo]:
    return parse_sinfo_json(_read_slurm("sinfo-busy.json"))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No XHPC_* variables and no user config from the real home; XHPC_STATE_DIR in tmp_path."""
    for key in list(os.environ):
        if key.startswith("XHPC_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    state = tmp_path / "state"
    monkeypatch.setenv("XHPC_STATE_DIR", str(state))
    return state


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A local model directory (what the catalog accepts as a path) named ``m``."""
    path = tmp_path / "models" / "m"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


# -- the CLI in-process: exit code, stdout, stderr ---------------------------------------
@dataclass
class Result:
    code: int
    out: str
    err: str


Run = Callable[..., Result]


def one_error_line(result: Result) -> str:
    """A failed command's whole stderr: one line, starting with ``error:``."""
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture
def xhpc(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Run:
    def run(*args: str) -> Result:
        monkeypatch.setattr(sys, "argv", ["xhpc", *args])
        with pytest.raises(SystemExit) as info:
            main()
        captured = capsys.readouterr()
        code = info.value.code
        return Result(code if isinstance(code, int) else 1, captured.out, captured.err)

    return run


OTHER_UID = 65534  # nobody: another member of the lab, on a node we share (tests run as root)


def give_to(path: Path, uid: int) -> None:
    """Everything at and under ``path`` now belongs to ``uid``, as if that user had made it."""
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), uid, uid)
    os.lchown(path, uid, uid)


def small_weights(root: Path) -> Path:
    """A model directory of a few files, one in a subdirectory (staging and pull tests)."""
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"w" * 100_000)
    (root / "sub" / "tok.json").write_text("[]")
    return root
