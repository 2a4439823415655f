"""The NVML adapter: the ONLY module that talks to `pynvml` (from nvidia-ml-py).

In the spirit of gpustat it degrades per field and per GPU: every field is read on its own, a
field the GPU does not support is None, a GPU whose handle fails or that reports "GPU is lost"
becomes an unhealthy row (``healthy=False, error=...``) — never an exception for the whole node.
Uncorrected volatile ECC errors also make a GPU unhealthy.

``pynvml`` is imported lazily (through importlib, so importing xhpc never needs the driver and tests
can put a fake module in ``sys.modules``); when the library or the driver is missing,
`NvmlUnavailable`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from xhpc.errors import XhpcError
from xhpc.models import GpuProbe, GpuProcess

MIB = 1024 * 1024
LOST_ERROR = "GPU is lost"

JobOf = Callable[[int], str | None]


class NvmlUnavailable(XhpcError):
    """The NVML library or the NVIDIA driver is missing (a CPU machine, or a broken driver)."""

    code = "nvml_unavailable"


def ecc_error(count: int) -> str:
    return f"{count} uncorrected ECC error(s) since the last driver load"


class _GpuLost(Exception):
    """Internal: a field read said the GPU is lost; the whole row becomes unhealthy."""


def load_pynvml() -> ModuleType:
    """Import pynvml and initialise NVML; `NvmlUnavailable` when either fails."""
    try:
        lib = importlib.import_module("pynvml")
    except ImportError as err:
        raise NvmlUnavailable(
            "the NVML bindings (nvidia-ml-py) are not installed",
            hint="pip install nvidia-ml-py, or use the fake probe backend",
        ) from err
    try:
        lib.nvmlInit()
    except lib.NVMLError as err:
        raise NvmlUnavailable(
            f"NVML cannot start: {err}",
            hint="no NVIDIA driver on this machine? use --backend fake",
        ) from err
    return lib


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _GpuReader:
    """Reads one GPU field by field; notes unreadable fields and the reasons a GPU is unhealthy."""

    def __init__(self, lib: ModuleType, handle: Any) -> None:
        self.lib = lib
        self.handle = handle
        self.notes: list[str] = []

    def field(self, what: str, read: Callable[[], Any]) -> Any:
        """``read()``, or None when the GPU cannot tell; raises `_GpuLost` when the GPU is gone."""
        lib = self.lib
        try:
            return read()
        except lib.NVMLError_GpuIsLost as err:
            raise _GpuLost(LOST_ERROR) from err
        except lib.NVMLError_NotSupported:
            return None
        except lib.NVMLError as err:
            self.notes.append(f"{what}: {err}")
            return None

    def row(self, index: int, job_of: JobOf | None) -> GpuProbe:
        lib, h = self.lib, self.handle
        name = self.field("name", lambda: _text(lib.nvmlDeviceGetName(h)))
        mem = self.field("memory", lambda: lib.nvmlDeviceGetMemoryInfo(h))
        util = self.field("utilisation", lambda: lib.nvmlDeviceGetUtilizationRates(h))
        temp = self.field(
            "temperature", lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)
        )
        ecc = self.field(
            "ecc",
            lambda: lib.nvmlDeviceGetTotalEccErrors(
                h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
            ),
        )
        procs = self.field("processes", lambda: lib.nvmlDeviceGetComputeRunningProcesses(h))
        healthy = not (ecc is not None and int(ecc) > 0)
        problems = [] if healthy else [ecc_error(int(ecc))]
        return GpuProbe(
            index=index,
            name=name,
            mem_used_mb=None if mem is None else mem.used / MIB,
            mem_total_mb=None if mem is None else mem.total / MIB,
            util_pct=None if util is None else float(util.gpu),
            temp_c=None if temp is None else float(temp),
            healthy=healthy,
            error="; ".join([*problems, *self.notes]) or None,
            processes=tuple(_process(p, job_of) for p in procs or ()),
        )


def _process(info: Any, job_of: JobOf | None) -> GpuProcess:
    pid = int(info.pid)
    used = getattr(info, "usedGpuMemory", None)  # None when the driver will not say
    return GpuProcess(
        pid=pid,
        mem_used_mb=None if used is None else used / MIB,
        job_id=job_of(pid) if job_of is not None else None,
    )


def _read_gpu(lib: ModuleType, index: int, job_of: JobOf | None) -> GpuProbe:
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
    except lib.NVMLError_GpuIsLost:
        return GpuProbe(index=index, healthy=False, error=LOST_ERROR)
    except lib.NVMLError as err:
        return GpuProbe(index=index, healthy=False, error=f"no handle: {err}")
    try:
        return _GpuReader(lib, handle).row(index, job_of)
    except _GpuLost:
        return GpuProbe(index=index, healthy=False, error=LOST_ERROR)


class NvmlSession:
    """An initialised NVML; keep one open while probing repeatedly, `close()` it at the end."""

    def __init__(self, lib: ModuleType | None = None) -> None:
        self._lib: ModuleType | None = lib if lib is not None else load_pynvml()

    def read_gpus(self, job_of: JobOf | None = None) -> list[GpuProbe]:
        """One row per GPU; ``job_of(pid)`` names the Slurm job of each GPU process."""
        lib = self._lib
        if lib is None:
            raise NvmlUnavailable("NVML session is closed")
        try:
            count = int(lib.nvmlDeviceGetCount())
        except lib.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot count the GPUs: {err}") from err
        return [_read_gpu(lib, i, job_of) for i in range(count)]

    def close(self) -> None:
        lib, self._lib = self._lib, None
        if lib is not None:
            with contextlib.suppress(lib.NVMLError):
                lib.nvmlShutdown()


def read_gpus(job_of: JobOf | None = None) -> list[GpuProbe]:
    """One-shot: start NVML, read every GPU, shut NVML down."""
    session = NvmlSession()
    try:
        return session.read_gpus(job_of)
    finally:
        session.close()
