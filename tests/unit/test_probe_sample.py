"""The fake GPU backend (file re-read at every sample) and sample()'s per-part degradation."""

from __future__ import annotations

import json
import os
from datetime import UTC
from pathlib import Path
from typing import Any

import psutil
import pytest

from xhpc.errors import ConfigError
from xhpc.models import GpuProbe
from xhpc.nvml import LOST_ERROR, NvmlUnavailable
from xhpc.probe.fake import FakeBackend
from xhpc.probe.sample import HostSampler, sample

NODE_TOML = """
count = 4

[[gpus]]
index = 1
name = "Fake H100"
mem_used_mb = 30000
util_pct = 95
processes = [{ pid = 4242, mem_used_mb = 30000, job_id = "17" }]

[[gpus]]
index = 2
lost = true

[[gpus]]
index = 3
processes = [{ pid = 999, mem_used_mb = 2048 }]
"""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_idle_gpus_without_a_file() -> None:
    rows = FakeBackend(gpus=3).read_gpus()
    assert [r.index for r in rows] == [0, 1, 2]
    assert all(r.healthy and r.mem_used_mb == 0 and r.processes == () for r in rows)
    assert FakeBackend().read_gpus() == []


def test_file_describes_load_a_lost_gpu_and_a_foreign_process(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(NODE_TOML)
    idle, busy, lost, orphan = FakeBackend(path, gpus=99).read_gpus()  # the file wins
    assert idle.healthy and idle.mem_used_mb == 0
    assert busy.name == "Fake H100" and busy.mem_used_mb == 30000 and busy.util_pct == 95
    assert [(p.pid, p.job_id) for p in busy.processes] == [(4242, "17")]
    assert not lost.healthy and lost.error == LOST_ERROR and lost.mem_used_mb is None
    assert orphan.mem_used_mb == 2048  # defaults to its processes' memory
    assert [(p.pid, p.job_id) for p in orphan.processes] == [(999, None)]


def test_json_file_and_positional_indexes(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"gpus": [{"util_pct": 10}, {"ecc_errors": 2}]}))
    first, second = FakeBackend(path).read_gpus()
    assert first.util_pct == 10 and first.healthy
    assert not second.healthy and second.error and "ECC" in second.error


def test_file_is_reread_at_every_sample(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    write_atomic(path, "count = 2\n")
    backend = FakeBackend(path)
    assert [r.healthy for r in backend.read_gpus()] == [True, True]
    write_atomic(path, "count = 2\n[[gpus]]\nindex = 0\nlost = true\n")
    assert [r.healthy for r in backend.read_gpus()] == [False, True]
    write_atomic(path, "count = 3\n")
    assert len(backend.read_gpus()) == 3


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("bad.toml", "count = [", "not valid|invalid"),
        ("bad.json", "{", "invalid"),
        ("unknown.toml", "cuont = 2\n", "cuont"),
        ("twice.toml", "[[gpus]]\nindex = 0\n[[gpus]]\nindex = 0\n", "described twice"),
        ("negative.toml", "[[gpus]]\nmem_used_mb = -1\n", "mem_used_mb"),
    ],
)
def test_a_wrong_file_is_a_config_error(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        FakeBackend(path).read_gpus()


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fake GPU file"):
        FakeBackend(tmp_path / "nope.toml").read_gpus()


# --- sample() -------------------------------------------------------------------------------


class BrokenBackend:
    name = "nvml"

    def read_gpus(self) -> list[GpuProbe]:
        raise NvmlUnavailable("NVML cannot count the GPUs: Unknown Error")

    def close(self) -> None:
        pass


def boom(*args: Any, **kwargs: Any) -> Any:
    raise PermissionError("no access to /proc/meminfo")


def test_sample_reads_gpus_cpu_and_memory() -> None:
    report = sample("node-1", FakeBackend(gpus=2), HostSampler())
    assert report.node == "node-1" and report.backend == "fake"
    assert report.taken_at.tzinfo is UTC
    assert len(report.gpus) == 2
    assert report.cpu_pct is not None and 0 <= report.cpu_pct <= 100
    assert report.mem_total_mb is not None and report.mem_used_mb is not None
    assert 0 < report.mem_used_mb <= report.mem_total_mb
    assert report.errors == ()


def test_sample_degrades_when_psutil_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    host = HostSampler()
    monkeypatch.setattr(psutil, "virtual_memory", boom)
    report = sample("node-1", FakeBackend(gpus=1), host)
    assert report.mem_used_mb is None and report.mem_total_mb is None
    assert report.cpu_pct is not None and len(report.gpus) == 1
    assert report.errors == ("memory: no access to /proc/meminfo",)

    monkeypatch.setattr(psutil, "cpu_percent", boom)
    report = sample("node-1", FakeBackend(gpus=1))  # priming fails quietly, the reading reports
    assert report.cpu_pct is None
    assert [e.split(":")[0] for e in report.errors] == ["cpu", "memory"]


def test_sample_degrades_when_the_gpu_backend_fails(tmp_path: Path) -> None:
    report = sample("node-1", BrokenBackend(), HostSampler())
    assert report.gpus == () and report.backend == "nvml"
    assert report.errors == ("gpus: NVML cannot count the GPUs: Unknown Error",)
    assert report.mem_total_mb is not None
    path = tmp_path / "node.toml"
    path.write_text("count = [")
    report = sample("node-1", FakeBackend(path), HostSampler())
    assert report.gpus == () and report.errors[0].startswith("gpus: fake GPU file")
