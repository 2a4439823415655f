"""An engine started with the time limit's warning blocked survives it: in a job step Slurm
signals every process of the step, and USR1 (no handler) would kill the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from xhpc import runner

# Waits for USR1 to arrive (pending when blocked), then says whether it is still alive.
CHILD = """
import os, signal, sys, time
print("up", flush=True)
deadline = time.monotonic() + 10
while time.monotonic() < deadline and signal.SIGUSR1 not in signal.sigpending():
    time.sleep(0.01)
print("survived", flush=True)
"""


async def _usr1(tmp_path: Path, blocked: tuple[signal.Signals, ...]) -> tuple[int, str]:
    out = tmp_path / f"out-{len(blocked)}"
    child = await runner.spawn(
        [sys.executable, "-c", CHILD], env=None, output=out, block_signals=blocked
    )
    for _ in range(1000):  # until it runs its loop
        if out.exists() and "up" in out.read_text():
            break
        await asyncio.sleep(0.01)
    child._signal_group(signal.SIGUSR1)
    code = await child.wait()
    return code, out.read_text()


async def test_a_blocked_usr1_does_not_kill_the_child_and_an_unblocked_one_does(
    tmp_path: Path,
) -> None:
    assert await _usr1(tmp_path, (signal.SIGUSR1,)) == (0, "up\nsurvived\n")
    code, _ = await _usr1(tmp_path, ())
    assert code == -signal.SIGUSR1
    # The parent's own mask is as it was.
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


# Starts a worker in its own process group (as vLLM starts its EngineCore), prints its pid, waits.
PARENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(worker.pid, flush=True)
time.sleep(60)
"""


async def test_stopping_a_child_that_died_ends_what_it_left_in_its_group(tmp_path: Path) -> None:
    """An engine killed by SIGKILL leaves its workers running; stop() ends them."""
    out = tmp_path / "out"
    child = await runner.spawn([sys.executable, "-c", PARENT], env=None, output=out)
    for _ in range(1000):
        if out.exists() and out.read_text().strip():
            break
        await asyncio.sleep(0.01)
    worker = int(out.read_text().split()[0])
    os.kill(child.pid, signal.SIGKILL)
    await child.wait()
    assert _alive(worker)  # orphaned, still running
    await child.stop(grace_s=0)
    for _ in range(500):
        if not _alive(worker):
            break
        await asyncio.sleep(0.01)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
