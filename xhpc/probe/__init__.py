"""The per-node probe: GPUs (NVML or fake), CPU and memory, reported to the broker."""

from xhpc.probe.backends import GpuBackend, NvmlBackend, open_backend
from xhpc.probe.fake import FakeBackend, FakeGpu, FakeNode, FakeProcess, load_fake_node
from xhpc.probe.procs import job_of_pid
from xhpc.probe.runner import run_probe
from xhpc.probe.sample import HostSampler, sample
from xhpc.probe.settings import ProbeSettings

__all__ = [
    "FakeBackend",
    "FakeGpu",
    "FakeNode",
    "FakeProcess",
    "GpuBackend",
    "HostSampler",
    "NvmlBackend",
    "ProbeSettings",
    "job_of_pid",
    "load_fake_node",
    "open_backend",
    "run_probe",
    "sample",
]
