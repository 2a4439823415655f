"""One probe snapshot of a node: its GPUs from a backend, CPU and memory through psutil.

Every part degrades on its own: what cannot be read is None and its reason goes to ``errors``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import psutil  # type: ignore[import-untyped, unused-ignore]

from xhpc.clock import monotonic, utcnow
from xhpc.models import GpuProbe, ProbeReport
from xhpc.probe.backends import GpuBackend

log = logging.getLogger(__name__)

T = TypeVar("T")
MIB = 1024 * 1024
# psutil.cpu_percent(interval=None) compares with the previous call; closer than this it is noise.
MIN_CPU_WINDOW_S = 0.1


def _why(err: BaseException) -> str:
    return getattr(err, "message", None) or str(err) or type(err).__name__


class HostSampler:
    """CPU and memory of this host. Created once per probe: it primes psutil's CPU counter."""

    def __init__(self) -> None:
        self._since = monotonic()
        try:
            psutil.cpu_percent(interval=None)
        except Exception as err:  # the first real reading reports it
            log.debug("cpu_percent priming failed: %s", err)

    def cpu_pct(self) -> float:
        """Busy CPU %, averaged since the previous reading (at least MIN_CPU_WINDOW_S)."""
        wait_s = MIN_CPU_WINDOW_S - (monotonic() - self._since)
        if wait_s > 0:
            time.sleep(wait_s)
        value = float(psutil.cpu_percent(interval=None))
        self._since = monotonic()
        return value

    def memory_mb(self) -> tuple[float, float]:
        """(used, total) in MiB."""
        mem = psutil.virtual_memory()
        return (mem.total - mem.available) / MIB, mem.total / MIB


def _attempt(what: str, read: Callable[[], T], errors: list[str]) -> T | None:
    try:
        return read()
    except Exception as err:  # a probe never dies on one unreadable part
        errors.append(f"{what}: {_why(err)}")
        return None


def sample(
    node: str,
    backend: GpuBackend,
    host: HostSampler | None = None,
    now: Callable[[], datetime] = utcnow,
) -> ProbeReport:
    """A snapshot of ``node``; pass the same ``host`` on every call of a long-running probe."""
    errors: list[str] = []
    taken_at = now()
    gpus: list[GpuProbe] | None = _attempt("gpus", backend.read_gpus, errors)
    host = host if host is not None else HostSampler()
    cpu = _attempt("cpu", host.cpu_pct, errors)
    mem = _attempt("memory", host.memory_mb, errors)
    return ProbeReport(
        node=node,
        taken_at=taken_at,
        backend=backend.name,
        gpus=tuple(gpus or ()),
        cpu_pct=cpu,
        mem_used_mb=None if mem is None else mem[0],
        mem_total_mb=None if mem is None else mem[1],
        errors=tuple(errors),
    )
