"""bench/proxy.py --short runs end to end: all four contenders in the table, and streams through
the xhpc proxy arrive whole (the event count the backend sent, the final [DONE]).

Needs nginx and .venvs/litellm (scripts/setup-bench installs both; CI runs it); without them the
test is skipped, saying which is missing. It asserts no speed: figures are for docs/performance.md.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "proxy.py"
LITELLM = ROOT / ".venvs" / "litellm" / "bin" / "litellm"
CONTENDERS = ["direct", "xhpc proxy", "nginx", "LiteLLM"]

pytestmark = pytest.mark.bench  # runs what scripts/setup-bench installs


def _missing() -> list[str]:
    missing = []
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        missing.append("nginx (Debian package)")
    if not LITELLM.exists():
        missing.append(f"LiteLLM (no {LITELLM})")
    return missing


def test_bench_proxy_short(tmp_path: Path) -> None:
    missing = _missing()
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}; run scripts/setup-bench")
    out = tmp_path / "proxy.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--short", "--require-all", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"bench/proxy.py failed:\n{proc.stderr[-4000:]}"
    table = proc.stdout
    for name in CONTENDERS:
        rows = [ln for ln in table.splitlines() if ln.startswith(f"| {name} |")]
        assert len(rows) == 3, f"{name}: expected a non-streaming and two SSE rows:\n{table}"

    data = json.loads(out.read_text())
    assert data["contenders"] == CONTENDERS
    assert data["plain"]["xhpc proxy"]["errors"] == 0, data["plain"]["xhpc proxy"]
    for workload in ("sse1", "sse32"):
        xhpc = data["sse"][workload]["xhpc proxy"]
        assert xhpc["streams"] > 0 and xhpc["errors"] == 0, (workload, xhpc)
        assert xhpc["events_match"] == xhpc["streams"], (workload, xhpc)
        assert xhpc["event_counts"] == [xhpc["expected_events"]], (workload, xhpc)
        assert xhpc["done"] == xhpc["streams"], (workload, xhpc)
