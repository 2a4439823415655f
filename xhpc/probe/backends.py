"""GPU backends of the probe: NVML on GPU nodes, the fake one elsewhere, ``auto`` between them."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Protocol

from xhpc.models import GpuProbe
from xhpc.nvml import NvmlSession, NvmlUnavailable
from xhpc.probe.fake import FakeBackend
from xhpc.probe.procs import PROC, job_of_pid
from xhpc.probe.settings import ProbeSettings

log = logging.getLogger(__name__)


class GpuBackend(Protocol):
    """Where a probe's GPU rows come from; ``read_gpus`` may raise XhpcError for the whole node."""

    @property
    def name(self) -> str: ...

    def read_gpus(self) -> list[GpuProbe]: ...

    def close(self) -> None: ...


class NvmlBackend:
    """The real GPUs through NVML, with each GPU process mapped to its Slurm job via /proc."""

    name = "nvml"

    def __init__(self, session: NvmlSession | None = None, proc_root: Path = PROC) -> None:
        self.session = session if session is not None else NvmlSession()
        self.job_of = functools.partial(job_of_pid, proc_root=proc_root)

    def read_gpus(self) -> list[GpuProbe]:
        return self.session.read_gpus(self.job_of)

    def close(self) -> None:
        self.session.close()


def open_backend(settings: ProbeSettings) -> GpuBackend:
    """The backend ``settings.backend`` names; ``auto`` falls back to the fake one without NVML."""
    if settings.backend in ("nvml", "auto"):
        try:
            return NvmlBackend(proc_root=settings.proc_root)
        except NvmlUnavailable as err:
            if settings.backend == "nvml":
                raise
            log.warning("%s; using the fake GPU backend", err.message)
    return FakeBackend(settings.fake_file, settings.fake_gpus)
