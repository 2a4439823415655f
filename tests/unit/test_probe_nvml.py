"""The NVML adapter against a fake `pynvml`; GPU processes mapped to Slurm jobs via a fake /proc."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from xhpc.errors import XhpcError
from xhpc.nvml import LOST_ERROR, NOTE_CHARS, NvmlSession, NvmlUnavailable, read_gpus
from xhpc.probe.backends import NvmlBackend, open_backend
from xhpc.probe.fake import FakeBackend
from xhpc.probe.procs import cgroup_job, job_of_pid, parent_pid, read_environ
from xhpc.probe.settings import ProbeSettings

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_GpuIsLost(NVMLError):  # pynvml's names, below too
    def __str__(self) -> str:
        return "GPU is lost"


class NVMLError_NotSupported(NVMLError):
    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_Unknown(NVMLError):
    def __str__(self) -> str:
        return "Unknown Error"


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class Gpu:
    """One fake device: each field is a value, or an exception the call raises."""

    name: Any = b"NVIDIA H100 80GB HBM3"
    handle: Any = None  # an exception: the handle itself cannot be had
    memory: Any = (1024 * MIB, 81559 * MIB)
    util: Any = 37
    temp: Any = 41
    ecc: Any = 0
    procs: Any = field(default_factory=list)


def fake_pynvml(gpus: list[Gpu], init: Exception | None = None) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    calls: list[str] = []

    def value(v: Any) -> Any:
        if isinstance(v, BaseException):
            raise v
        return v

    def nvmlInit() -> None:
        calls.append("init")
        if init is not None:
            raise init

    def nvmlShutdown() -> None:
        calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(i: int) -> Gpu:
        gpu = gpus[i]
        value(gpu.handle)
        return gpu

    def memory(h: Gpu) -> Any:
        used, total = value(h.memory)
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    def ecc(h: Gpu, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return int(value(h.ecc))

    def temperature(h: Gpu, sensor: int) -> int:
        assert sensor == 0
        return int(value(h.temp))

    mod.__dict__.update(
        NVMLError=NVMLError,
        NVMLError_GpuIsLost=NVMLError_GpuIsLost,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVMLError_Unknown=NVMLError_Unknown,
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        calls=calls,
        nvmlInit=nvmlInit,
        nvmlShutdown=nvmlShutdown,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetName=lambda h: value(h.name),
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=value(h.util), memory=0),
        nvmlDeviceGetTemperature=temperature,
        nvmlDeviceGetTotalEccErrors=ecc,
        nvmlDeviceGetComputeRunningProcesses=lambda h: value(h.procs),
    )
    return mod


def test_the_fake_offers_only_what_the_real_bindings_have() -> None:
    """Every call and constant of the fake exists in the real nvidia-ml-py, constants equal. (The
    fake once offered nvmlDeviceGetComputeProcesses, which pynvml lacks: on a real H200 the whole
    GPU list came back empty.) Importing pynvml needs no driver, so this runs on CPU machines."""
    real = pytest.importorskip("pynvml")
    fake = fake_pynvml([])
    names = [n for n in vars(fake) if n.startswith(("nvml", "NVML"))]
    assert [n for n in names if not hasattr(real, n)] == []
    consts = [n for n in names if n.startswith("NVML_")]
    assert {n: getattr(real, n) for n in consts} == {n: getattr(fake, n) for n in consts}


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Any:
    def put(gpus: list[Gpu], init: Exception | None = None) -> types.ModuleType:
        mod = fake_pynvml(gpus, init)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return put


def write_proc(
    root: Path,
    pid: int,
    ppid: int,
    env: dict[str, str] | None = None,
    comm: str = "python",
    cgroup: str | None = None,
) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0\n")
    if env is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)


def test_healthy_gpus_read_field_by_field(install: Any) -> None:
    mod = install([Gpu(), Gpu(name="NVIDIA A100", util=100, temp=70)])
    rows = read_gpus()
    assert [r.index for r in rows] == [0, 1]
    first = rows[0]
    assert first.name == "NVIDIA H100 80GB HBM3"  # bytes from old bindings are decoded
    assert first.mem_used_mb == 1024 and first.mem_total_mb == 81559
    assert first.util_pct == 37 and first.temp_c == 41
    assert first.healthy and first.error is None and first.processes == ()
    assert rows[1].name == "NVIDIA A100" and rows[1].util_pct == 100
    assert mod.calls == ["init", "shutdown"]


def test_a_lost_gpu_is_an_unhealthy_row_not_a_crash(install: Any) -> None:
    install(
        [
            Gpu(),
            Gpu(handle=NVMLError_GpuIsLost()),  # lost before we get a handle
            Gpu(memory=NVMLError_GpuIsLost()),  # lost in the middle of a read
            Gpu(handle=NVMLError_Unknown()),
        ]
    )
    rows = read_gpus()
    assert len(rows) == 4
    assert rows[0].healthy
    for lost in rows[1:3]:
        assert not lost.healthy and lost.error == LOST_ERROR
        assert lost.mem_used_mb is None and lost.name is None
    assert not rows[3].healthy and rows[3].error == "no handle: Unknown Error"


def test_unsupported_field_is_none_and_the_gpu_stays_healthy(install: Any) -> None:
    install([Gpu(temp=NVMLError_NotSupported(), ecc=NVMLError_NotSupported())])
    (row,) = read_gpus()
    assert row.temp_c is None
    assert row.healthy and row.error is None
    assert row.mem_used_mb == 1024 and row.util_pct == 37


def test_unreadable_field_is_none_and_noted(install: Any) -> None:
    install([Gpu(util=NVMLError_Unknown())])
    (row,) = read_gpus()
    assert row.util_pct is None and row.healthy
    assert row.error == "utilisation: Unknown Error"


HEALTHY = {
    "name": "NVIDIA H100 80GB HBM3",
    "mem_used_mb": 1024.0,
    "mem_total_mb": 81559.0,
    "util_pct": 37.0,
    "temp_c": 41.0,
}


def readings(row: Any) -> dict[str, Any]:
    return {k: getattr(row, k) for k in HEALTHY}


@pytest.mark.parametrize(
    ("fault", "lost", "note"),
    [
        ({"name": AttributeError("no name")}, "name", "name: AttributeError: no name"),
        ({"memory": TypeError("bad")}, "mem_used_mb", "memory: TypeError: bad"),
        ({"util": ValueError("odd")}, "util_pct", "utilisation: ValueError: odd"),
        ({"temp": RuntimeError("x")}, "temp_c", "temperature: RuntimeError: x"),
        ({"ecc": KeyError("ecc")}, None, "ecc: KeyError: 'ecc'"),
        ({"procs": OSError("gone")}, None, "processes: OSError: gone"),
    ],
)
def test_any_exception_from_one_field_costs_that_field_only(
    install: Any, fault: dict[str, Any], lost: str | None, note: str
) -> None:
    """A non-NVML error (a binding without a call, an odd value) is not the node's whole list:
    the field is None, noted in the row, and every other field and GPU is read."""
    install([Gpu(procs=[Proc(7, MIB)]), Gpu(**{"procs": [Proc(8, MIB)], **fault}), Gpu()])
    first, broken, third = read_gpus()
    assert readings(first) == readings(third) == HEALTHY and first.error is None
    expected = {**HEALTHY, lost: None} if lost else HEALTHY
    if lost == "mem_used_mb":
        expected = {**expected, "mem_total_mb": None}
    assert readings(broken) == expected
    assert broken.healthy and broken.error == note  # unknown is not unhealthy
    assert [p.pid for p in broken.processes] == ([] if "procs" in fault else [8])


def test_odd_values_are_none_and_noted(install: Any) -> None:
    install(
        [
            Gpu(util="n/a", memory=(1j, 81559 * MIB), procs=[Proc("x", MIB)]),  # type: ignore[arg-type]
            Gpu(util=float("nan")),
        ]
    )
    odd, nan = read_gpus()
    assert (odd.util_pct, odd.mem_used_mb, odd.mem_total_mb, odd.processes) == (
        None,
        None,
        None,
        (),
    )
    assert odd.name == HEALTHY["name"] and odd.temp_c == 41 and odd.healthy
    assert odd.error is not None
    assert odd.error.split("; ") == [
        "memory: TypeError: float() argument must be a string or a real number, not 'complex'",
        "utilisation: ValueError: could not convert string to float: 'n/a'",
        "processes: ValueError: invalid literal for int() with base 10: 'x'",
    ]
    assert nan.util_pct is None and nan.error == "utilisation: ValueError: not a finite number: nan"


def test_bindings_without_a_call_lose_that_field_on_every_gpu(install: Any) -> None:
    mod = install([Gpu(), Gpu()])
    del mod.nvmlDeviceGetTemperature
    rows = read_gpus()
    for row in rows:
        assert readings(row) == {**HEALTHY, "temp_c": None} and row.healthy
        assert row.error == (
            "temperature: AttributeError: module 'pynvml' has no attribute"
            " 'nvmlDeviceGetTemperature'"
        )


def test_bindings_without_an_error_class_still_degrade_per_field(install: Any) -> None:
    mod = install([Gpu(temp=NVMLError_NotSupported(), util=NVMLError_GpuIsLost())])
    del mod.NVMLError_NotSupported, mod.NVMLError_GpuIsLost  # old bindings: only NVMLError
    (row,) = read_gpus()
    assert (row.temp_c, row.util_pct, row.mem_used_mb) == (None, None, 1024)
    assert row.error == "utilisation: GPU is lost; temperature: Not Supported"


def test_a_handle_or_count_failing_oddly_is_a_row_or_nvml_unavailable(install: Any) -> None:
    install([Gpu(handle=TypeError("no index")), Gpu()])
    broken, fine = read_gpus()
    assert not broken.healthy and broken.error == "no handle: TypeError: no index"
    assert readings(fine) == HEALTHY
    mod = install([Gpu()])
    mod.nvmlDeviceGetCount = lambda: "two"
    with pytest.raises(NvmlUnavailable, match="cannot count the GPUs: ValueError"):
        read_gpus()
    install([Gpu()], init=TypeError("odd bindings"))
    with pytest.raises(NvmlUnavailable, match="cannot start: TypeError: odd bindings"):
        NvmlSession()


def test_a_long_error_note_is_cut(install: Any) -> None:
    install([Gpu(util=ValueError("x" * 10_000))])
    (row,) = read_gpus()
    assert row.error is not None and len(row.error) == len("utilisation: ") + NOTE_CHARS
    assert row.error.startswith("utilisation: ValueError: xxx") and row.error.endswith("...")


def test_keyboard_interrupt_and_exit_are_never_swallowed(install: Any) -> None:
    install([Gpu(temp=KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        read_gpus()
    install([Gpu(handle=SystemExit(3))])
    with pytest.raises(SystemExit):
        read_gpus()


def test_uncorrected_ecc_errors_make_a_gpu_unhealthy(install: Any) -> None:
    install([Gpu(ecc=3), Gpu(ecc=0)])
    bad, good = read_gpus()
    assert not bad.healthy and bad.error is not None and "3 uncorrected ECC" in bad.error
    assert bad.mem_used_mb == 1024  # the other fields are still read
    assert good.healthy


def test_processes_are_mapped_to_slurm_jobs_through_proc(install: Any, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    write_proc(proc, 100, 1, {"SLURM_JOB_ID": "17", "PATH": "/bin"})  # the engine of job 17
    write_proc(proc, 150, 1, {"SLURM_JOB_ID": "18"})  # the agent of job 18 ...
    write_proc(proc, 200, 150, {"PATH": "/bin"})  # ... and its engine, started with a clean env
    write_proc(proc, 300, 1, {"HOME": "/root"})  # nobody's: a foreign process
    install(
        [
            Gpu(procs=[Proc(100, 2048 * MIB), Proc(200, 512 * MIB)]),
            Gpu(procs=[Proc(300, 4096 * MIB), Proc(999, None)]),
        ]
    )
    backend = NvmlBackend(proc_root=proc)
    try:
        rows = backend.read_gpus()
    finally:
        backend.close()
    assert [(p.pid, p.job_id, p.mem_used_mb) for p in rows[0].processes] == [
        (100, "17", 2048),
        (200, "18", 512),
    ]
    assert [(p.pid, p.job_id, p.mem_used_mb) for p in rows[1].processes] == [
        (300, None, 4096),
        (999, None, None),  # gone from /proc, memory not reported: still listed, as foreign
    ]
    assert all(r.healthy for r in rows)


def test_missing_bindings_or_driver_is_nvml_unavailable(
    install: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(NvmlUnavailable) as info:
        read_gpus()
    assert isinstance(info.value, XhpcError) and info.value.hint
    install([Gpu()], init=NVMLError("Driver Not Loaded"))
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        NvmlSession()


def test_closed_session_refuses(install: Any) -> None:
    install([Gpu()])
    session = NvmlSession()
    session.close()
    session.close()  # twice is fine
    with pytest.raises(NvmlUnavailable):
        session.read_gpus()


def test_auto_backend_falls_back_to_fake_without_nvml(
    install: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    backend = open_backend(ProbeSettings(backend="auto", fake_gpus=3))
    assert isinstance(backend, FakeBackend) and len(backend.read_gpus()) == 3
    with pytest.raises(NvmlUnavailable):
        open_backend(ProbeSettings(backend="nvml"))
    install([Gpu(), Gpu()])
    real = open_backend(ProbeSettings(backend="auto"))
    assert real.name == "nvml" and len(real.read_gpus()) == 2
    real.close()


# --- /proc ----------------------------------------------------------------------------------------


def test_job_of_pid_walks_a_few_parents_only(tmp_path: Path) -> None:
    write_proc(tmp_path, 10, 1, {"SLURM_JOB_ID": "42"})
    for pid in range(11, 17):  # a chain 10 <- 11 <- ... <- 16
        write_proc(tmp_path, pid, pid - 1, {})
    assert job_of_pid(10, tmp_path) == "42"
    assert job_of_pid(14, tmp_path) == "42"  # four levels up
    assert job_of_pid(16, tmp_path) is None  # six levels: too far, not guessed
    assert job_of_pid(16, tmp_path, max_depth=6) == "42"
    assert job_of_pid(12345, tmp_path) is None  # no such process


def test_job_of_pid_ignores_garbage_and_falls_back_to_the_cgroup(tmp_path: Path) -> None:
    write_proc(tmp_path, 20, 1, {"SLURM_JOB_ID": "1; rm -rf /"})
    assert job_of_pid(20, tmp_path) is None
    v1 = "12:devices:/slurm/uid_1000/job_77/step_0/task_0\n0::/\n"
    write_proc(tmp_path, 21, 1, None, cgroup=v1)  # environ unreadable (another user's process)
    assert job_of_pid(21, tmp_path) == "77"
    v2 = "0::/system.slice/slurmstepd.scope/job_78/step_batch/user/task_0\n"
    write_proc(tmp_path, 22, 1, {}, cgroup=v2)
    assert cgroup_job(22, tmp_path) == "78"
    write_proc(tmp_path, 23, 1, {}, cgroup="0::/user.slice/user-1000.slice/job_x\n")
    assert job_of_pid(23, tmp_path) is None


def test_proc_parsing_survives_odd_command_names(tmp_path: Path) -> None:
    write_proc(tmp_path, 30, 29, {"A": "x=y", "B": ""}, comm="a) (b c")
    assert parent_pid(30, tmp_path) == 29
    assert read_environ(30, tmp_path) == {"A": "x=y", "B": ""}
    (tmp_path / "31").mkdir()
    (tmp_path / "31" / "stat").write_text("31 (x")
    assert parent_pid(31, tmp_path) is None
    assert read_environ(31, tmp_path) is None
