"""A fake GPU backend for CPU machines (dev cluster, tests), driven by a small TOML or JSON file.

The file is re-read at every sample, so a test can change a node's GPUs while its probe runs (write
it atomically: a half-written file is reported as an error for that sample). Without a file: N idle
GPUs. Example (TOML; JSON has the same shape)::

    count = 4                      # GPUs 0..3, idle unless described below

    [[gpus]]
    index = 1
    mem_used_mb = 30000
    util_pct = 95
    processes = [{ pid = 4242, mem_used_mb = 30000, job_id = "17" }]

    [[gpus]]
    index = 2
    lost = true                    # "GPU is lost": an unhealthy row

    [[gpus]]
    index = 3
    processes = [{ pid = 999, mem_used_mb = 2048 }]   # no job_id: a foreign process (an orphan)

A described GPU's ``index`` defaults to its position in the list; the node has
``max(count, highest index + 1)`` GPUs.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticValidationError

from xhpc.errors import ConfigError, plain_message
from xhpc.models import GpuProbe, GpuProcess
from xhpc.nvml import LOST_ERROR, ecc_error


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FakeProcess(_Spec):
    pid: int = Field(ge=1)
    mem_used_mb: float | None = Field(default=None, ge=0)
    job_id: str | None = Field(default=None, pattern=r"^\d+([_+]\d+)?$")  # None: foreign


class FakeGpu(_Spec):
    index: int | None = Field(default=None, ge=0, lt=1024)
    name: str = "Fake GPU"
    mem_total_mb: float = Field(default=81920.0, ge=0)
    mem_used_mb: float | None = Field(default=None, ge=0)  # None: the sum of its processes' memory
    util_pct: float = Field(default=0.0, ge=0, le=100)
    temp_c: float = 30.0
    lost: bool = False
    ecc_errors: int = Field(default=0, ge=0)
    processes: list[FakeProcess] = Field(default_factory=list)


class FakeNode(_Spec):
    count: int = Field(default=0, ge=0, le=1024)
    gpus: list[FakeGpu] = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct(self) -> FakeNode:
        seen: set[int] = set()
        for i, spec in enumerate(self.gpus):
            index = spec.index if spec.index is not None else i
            if index in seen:
                raise ValueError(f"GPU index {index} is described twice")
            seen.add(index)
        return self

    def described(self) -> dict[int, FakeGpu]:
        return {
            spec.index if spec.index is not None else i: spec for i, spec in enumerate(self.gpus)
        }


def _row(index: int, spec: FakeGpu) -> GpuProbe:
    if spec.lost:
        return GpuProbe(index=index, healthy=False, error=LOST_ERROR)
    used = spec.mem_used_mb
    if used is None:
        used = sum(p.mem_used_mb or 0.0 for p in spec.processes)
    return GpuProbe(
        index=index,
        name=spec.name,
        mem_used_mb=used,
        mem_total_mb=spec.mem_total_mb,
        util_pct=spec.util_pct,
        temp_c=spec.temp_c,
        healthy=spec.ecc_errors == 0,
        error=ecc_error(spec.ecc_errors) if spec.ecc_errors else None,
        processes=tuple(
            GpuProcess(pid=p.pid, mem_used_mb=p.mem_used_mb, job_id=p.job_id)
            for p in spec.processes
        ),
    )


def node_gpus(node: FakeNode) -> list[GpuProbe]:
    """The rows a fake node reports: described GPUs as described, the others idle."""
    described = node.described()
    total = max([node.count, *(i + 1 for i in described)])
    return [_row(i, described.get(i, FakeGpu())) for i in range(total)]


def load_fake_node(path: Path) -> FakeNode:
    """Parse a fake-GPU file (``.json``: JSON, else TOML); `ConfigError` when it is wrong."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"fake GPU file {path}: {err.strerror or err}") from err
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
        return FakeNode.model_validate(data)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        # json.JSONDecodeError, UnicodeDecodeError and pydantic's error are ValueErrors too.
        raise ConfigError(f"fake GPU file {path} is invalid: {_describe(err)}") from err


def _describe(err: Exception) -> str:
    if not isinstance(err, PydanticValidationError):
        return str(err)
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "file"
    if first["type"] == "extra_forbidden":
        loc = first["loc"]
        model = FakeProcess if "processes" in loc else FakeGpu if "gpus" in loc else FakeNode
        return f"{where}: unknown key; valid keys: {', '.join(model.model_fields)}"
    return f"{where}: {plain_message(first['msg'])}"


class FakeBackend:
    """GPUs from a file (re-read every sample) or ``gpus`` idle ones."""

    name = "fake"

    def __init__(self, file: Path | None = None, gpus: int = 0) -> None:
        self.file = file
        self.gpus = gpus

    def read_gpus(self) -> list[GpuProbe]:
        node = load_fake_node(self.file) if self.file is not None else FakeNode(count=self.gpus)
        return node_gpus(node)

    def close(self) -> None:
        pass
