"""The house checks run in CI with the tests: lint, format, types, layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "argv",
    [
        ["ruff", "check", "xhpc", "tests", "bench"],
        ["ruff", "format", "--check", "xhpc", "tests", "bench"],
        ["mypy"],
        ["lint-imports"],
    ],
    ids=["ruff-check", "ruff-format", "mypy", "import-linter"],
)
def test_house_check(argv: list[str]) -> None:
    proc = subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
