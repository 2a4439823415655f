"""The NVML adapter: the ONLY module that talks to `pynvml` (from nvidia-ml-py).

In the spirit of gpustat it degrades per field and per GPU: every field is read (and converted)
on its own, a field the GPU does not support is None, a field that fails in any other way — an
NVML error, or any ``Exception`` from bindings without a call, odd values, ... — is None with a
note in the row's ``error``; a GPU whose handle fails or that reports "GPU is lost" becomes an
unhealthy row (``healthy=False, error=...``) — never an exception for the whole node. Only
``BaseException``-level things (KeyboardInterrupt, SystemExit) pass through. Uncorrected volatile
ECC errors also make a GPU unhealthy.

``pynvml`` is imported lazily (through importlib, so importing xhpc never needs the driver and tests
can put a fake module in ``sys.modules``); when the library or the driver is missing,
`NvmlUnavailable`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

from xhpc.errors import XhpcError
from xhpc.models import GpuProbe, GpuProcess

MIB = 1024 * 1024
LOST_ERROR = "GPU is lost"
NOTE_CHARS = 200  # an error note is cut here (odd values may carry long text)

JobOf = Callable[[int], str | None]


class NvmlUnavailable(XhpcError):
    """The NVML library or the NVIDIA driver is missing (a CPU machine, or a broken driver)."""

    code = "nvml_unavailable"


def ecc_error(count: int) -> str:
    return f"{count} uncorrected ECC error(s) since the last driver load"


class _GpuLost(Exception):
    """Internal: a field read said the GPU is lost; the whole row becomes unhealthy."""


class _NeverRaised(Exception):
    """Internal: stands for an NVML error class the bindings lack (so none is ever caught)."""


def _error_class(lib: ModuleType, name: str) -> type[Exception]:
    """``lib.<name>`` if it is an exception class: old or odd bindings may lack it, and an
    ``except`` clause that names a missing attribute would itself raise."""
    found = getattr(lib, name, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else _NeverRaised


def _why(err: Exception, nvml_error: type[Exception]) -> str:
    """An NVML error as NVML says it; anything else with its class name (``TypeError: ...``)."""
    text = str(err) if isinstance(err, nvml_error) else f"{type(err).__name__}: {err}"
    return text if len(text) <= NOTE_CHARS else text[: NOTE_CHARS - 3] + "..."


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
    except Exception as err:  # NVML's error, or odd bindings (no such call, ...)
        raise NvmlUnavailable(
            f"NVML cannot start: {_why(err, _error_class(lib, 'NVMLError'))}",
            hint="no NVIDIA driver on this machine? use --backend fake",
        ) from err
    return lib


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Errors:
    """The bindings' error classes, looked up once (any of them may be missing)."""

    def __init__(self, lib: ModuleType) -> None:
        self.nvml = _error_class(lib, "NVMLError")
        self.lost = _error_class(lib, "NVMLError_GpuIsLost")
        self.not_supported = _error_class(lib, "NVMLError_NotSupported")


class _GpuReader:
    """Reads one GPU field by field; notes unreadable fields and the reasons a GPU is unhealthy."""

    def __init__(self, lib: ModuleType, errors: _Errors, handle: Any) -> None:
        self.lib = lib
        self.errors = errors
        self.handle = handle
        self.notes: list[str] = []

    def field(self, what: str, read: Callable[[], Any]) -> Any:
        """``read()`` (the call and the conversion of its value), or None when the GPU cannot
        tell or the read fails in any way (noted); raises `_GpuLost` when the GPU is gone."""
        errors = self.errors
        try:
            return read()
        except errors.lost as err:
            raise _GpuLost(LOST_ERROR) from err
        except errors.not_supported:
            return None
        except Exception as err:  # NVML's or not (no such call, odd values): this field only
            self.notes.append(f"{what}: {_why(err, errors.nvml)}")
            return None

    def row(self, index: int, job_of: JobOf | None) -> GpuProbe:
        lib, h = self.lib, self.handle
        name = self.field("name", lambda: _text(lib.nvmlDeviceGetName(h)))
        mem = self.field("memory", lambda: _memory_mb(lib.nvmlDeviceGetMemoryInfo(h)))
        util = self.field("utilisation", lambda: _number(lib.nvmlDeviceGetUtilizationRates(h).gpu))
        temp = self.field(
            "temperature",
            lambda: _number(lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)),
        )
        ecc = self.field(
            "ecc",
            lambda: int(
                lib.nvmlDeviceGetTotalEccErrors(
                    h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
                )
            ),
        )
        procs = self.field(
            "processes",
            lambda: tuple(_process(p, job_of) for p in lib.nvmlDeviceGetComputeRunningProcesses(h)),
        )
        healthy = not (ecc is not None and ecc > 0)
        problems = [] if healthy else [ecc_error(ecc)]
        return GpuProbe(
            index=index,
            name=name,
            mem_used_mb=None if mem is None else mem[0],
            mem_total_mb=None if mem is None else mem[1],
            util_pct=util,
            temp_c=temp,
            healthy=healthy,
            error="; ".join([*problems, *self.notes]) or None,
            processes=procs or (),
        )


def _number(value: Any) -> float:
    """A reading as a float; a value that is not a finite number is a ValueError."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {number}")
    return number


def _memory_mb(info: Any) -> tuple[float, float]:
    """(used, total) in MiB."""
    return _number(info.used) / MIB, _number(info.total) / MIB


def _process(info: Any, job_of: JobOf | None) -> GpuProcess:
    pid = int(info.pid)
    used = getattr(info, "usedGpuMemory", None)  # None when the driver will not say
    return GpuProcess(
        pid=pid,
        mem_used_mb=None if used is None else _number(used) / MIB,
        job_id=job_of(pid) if job_of is not None else None,
    )


def _read_gpu(lib: ModuleType, errors: _Errors, index: int, job_of: JobOf | None) -> GpuProbe:
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
    except errors.lost:
        return GpuProbe(index=index, healthy=False, error=LOST_ERROR)
    except Exception as err:
        return GpuProbe(index=index, healthy=False, error=f"no handle: {_why(err, errors.nvml)}")
    try:
        return _GpuReader(lib, errors, handle).row(index, job_of)
    except _GpuLost:
        return GpuProbe(index=index, healthy=False, error=LOST_ERROR)
    except Exception as err:  # not a field's failure (those are caught): this GPU only
        return GpuProbe(index=index, healthy=False, error=f"unreadable: {_why(err, errors.nvml)}")


class NvmlSession:
    """An initialised NVML; keep one open while probing repeatedly, `close()` it at the end."""

    def __init__(self, lib: ModuleType | None = None) -> None:
        self._lib: ModuleType | None = lib if lib is not None else load_pynvml()

    def read_gpus(self, job_of: JobOf | None = None) -> list[GpuProbe]:
        """One row per GPU; ``job_of(pid)`` names the Slurm job of each GPU process."""
        lib = self._lib
        if lib is None:
            raise NvmlUnavailable("NVML session is closed")
        errors = _Errors(lib)
        try:
            count = int(lib.nvmlDeviceGetCount())
        except Exception as err:
            why = _why(err, errors.nvml)
            raise NvmlUnavailable(f"NVML cannot count the GPUs: {why}") from err
        return [_read_gpu(lib, errors, i, job_of) for i in range(count)]

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
