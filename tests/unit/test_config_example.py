"""`xhpc config example`: the packaged example of a site file, printed even with no site file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from xhpc.config import SITE_EXAMPLE

XHPC = str(Path(sys.executable).parent / "xhpc")


def test_config_example_prints_the_packaged_site_file_even_where_no_site_file_exists() -> None:
    done = subprocess.run(
        [XHPC, "config", "example"], env={"XHPC_SITE_CONFIG": "/nonexistent/site.toml",
                                          "HOME": "/nonexistent"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == SITE_EXAMPLE.read_text()
    assert "[policy]" in done.stdout and "[proxy]" in done.stdout
