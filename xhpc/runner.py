"""The one place that starts subprocesses.

``run`` executes a short command (argv list, never a shell) with a timeout and returns its
captured result; ``spawn`` starts a long-running child (an inference engine) with an explicit
environment and output file. Success is the return code, never "stderr was empty".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


class CommandFailed(Exception):
    """A command could not run or exited non-zero; carries the evidence."""

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int | None,
        stdout: str,
        stderr: str,
        why: str,
        *,
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"{argv[0] if argv else '?'}: {why}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.why = why
        self.timed_out = timed_out  # killed at its timeout: what it started may have happened


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


async def run(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    stdin: str | None = None,
) -> Completed:
    argv = [str(a) for a in argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except OSError as err:
        raise CommandFailed(argv, None, "", str(err), f"cannot start: {err}") from err
    try:
        out, err_b = await asyncio.wait_for(
            proc.communicate(stdin.encode() if stdin is not None else None), timeout_s
        )
    except TimeoutError as err:
        proc.kill()
        await proc.wait()
        why = f"timed out after {timeout_s:.0f}s"
        raise CommandFailed(argv, None, "", "", why, timed_out=True) from err
    except asyncio.CancelledError:  # the caller gave up waiting (a bounded fan-out): no orphan
        proc.kill()
        await proc.wait()
        raise
    result = Completed(
        argv, proc.returncode or 0, out.decode(errors="replace"), err_b.decode(errors="replace")
    )
    if check and result.returncode != 0:
        raise CommandFailed(
            argv, result.returncode, result.stdout, result.stderr, f"exit {result.returncode}"
        )
    return result


class Child:
    """A long-running child process started by ``spawn``."""

    def __init__(self, proc: asyncio.subprocess.Process, argv: list[str]) -> None:
        self.proc = proc
        self.argv = argv

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    async def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM the child's process group, then SIGKILL after ``grace_s``; once the child has
        exited (also when it had before), SIGKILL what is left of its group: processes it
        started and did not take with it (an engine's worker whose parent was killed)."""
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                log.warning("child %d did not stop in %.0fs; killing it", self.pid, grace_s)
                self._signal_group(signal.SIGKILL)
                await self.proc.wait()
        self._signal_group(signal.SIGKILL)
        return self.proc.returncode if self.proc.returncode is not None else -signal.SIGKILL

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


async def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None,
    output: Path | None,
    cwd: Path | None = None,
    pass_fds: Sequence[int] = (),
    block_signals: Iterable[signal.Signals] = (),
) -> Child:
    """Start ``argv`` in its own process group, stdout+stderr appended to ``output`` (None:
    this process's stdout and stderr), with ``env`` (None: this process's environment).
    ``pass_fds``: descriptors the child inherits (every other one is closed in it).
    ``block_signals``: signals the child starts with blocked (a blocked signal stays blocked
    across exec, and in the child's own children): what a job step sends to all its processes
    and only the parent should act on."""
    argv = [str(a) for a in argv]
    with contextlib.ExitStack() as stack:
        out: int | IO[bytes] | None = None
        err: int | None = None
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)
            out, err = stack.enter_context(output.open("ab")), asyncio.subprocess.STDOUT
        blocked = set(block_signals)
        if blocked:  # the fork happens in this thread: the child inherits this thread's mask
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            stack.callback(signal.pthread_sigmask, signal.SIG_SETMASK, old_mask)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    return Child(proc, argv)
