"""The one poll loop every launch is timed with, and the rounds.

A run starts the contender's launch command (its clock starts just before) and then, every
POLL_S (start to start; longer only when a look takes longer), looks in this order: has the
command returned (stamped by a thread waiting on it, so the "submit" phase is exact; its output
then gives the job id); until the job is RUNNING, squeue by the launch's unique job name (the
job may run before a slow command returns); once its server's address is known, one chat
completion (``max_tokens`` 1). Phases are the seconds from the start to the moment each was
seen. The run ends at the first HTTP 200, once the command has returned too; or it fails: the
command exits non-zero or prints no job id, the job leaves squeue (checked every LIVENESS_S once
RUNNING), or TIMEOUT_S passes. Every run's job is stopped before the next starts, and waited
out of squeue.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from bench._common import die_with_parent

from .cluster import chat_ok, job_rows, scancel, wait_gone
from .contenders import Contender, Launch, Run
from .params import GONE_TIMEOUT_S, LABELS, LIVENESS_S, POLL_S, log

# States of a job that has not ended
ALIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"})


def tail(path: os.PathLike[str] | str, chars: int = 600) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-chars:].strip()
    except OSError:
        return ""


class Follow:
    """One launch followed to its first answer (or its failure), recorded in ``run``."""

    def __init__(self, contender: Contender, run: Run, timeout_s: float) -> None:
        self.c, self.run, self.timeout_s = contender, run, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.exited = threading.Event()
        self.exited_at = 0.0
        self.waiter: threading.Thread | None = None
        self.endpoint: tuple[str, int] | None = None
        self.next_live = 0.0

    def go(self) -> None:
        self.start()
        try:
            while not self.tick():
                pass
        finally:
            self.finish()

    def start(self) -> None:
        launch = self.run.launch
        with open(launch.stdout, "wb") as out, open(launch.stderr, "wb") as err:
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen(
                launch.argv, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                stdout=out, stderr=err, start_new_session=True,
                preexec_fn=die_with_parent,  # no thread of ours runs yet
            )  # fmt: skip
        self.waiter = threading.Thread(target=self._wait, args=(self.proc,), daemon=True)
        self.waiter.start()

    def _wait(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self.exited_at = time.monotonic()
        self.exited.set()

    def since(self) -> float:
        return time.monotonic() - self.t0

    def tick(self) -> bool:
        """One look; True when the run is over (answered or failed)."""
        started = time.monotonic()
        if started - self.t0 > self.timeout_s:
            self.run.error = self.timeout_message()
            return True
        if self.exited.is_set() and self.run.submit_s is None and not self.returned():
            return True
        if self.run.running_s is None:
            if self.look_for_running():
                return True
        elif started >= self.next_live and self.job_ended():
            return True
        if self.run.first_200_s is None:
            self.ask_server()
        if self.run.first_200_s is not None and self.run.submit_s is not None:
            return True  # answered, and the command returned (it may answer first: not killed)
        self.pause_until(started + POLL_S)
        return False

    def ask_server(self) -> None:
        """One chat completion, once the contender knows where its server listens."""
        if self.endpoint is None:
            self.endpoint = self.c.endpoint(self.run)
        if self.endpoint is not None and chat_ok(*self.endpoint, self.run.launch.served):
            self.run.first_200_s = self.since()

    def pause_until(self, when: float) -> None:
        """Sleep until ``when``; the launch command's exit ends the pause at once."""
        left = when - time.monotonic()
        if left <= 0:
            return
        if self.exited.is_set():
            time.sleep(left)
        else:
            self.exited.wait(left)

    def returned(self) -> bool:
        """Record the command's return; False when it failed (exit status, no job id)."""
        assert self.proc is not None
        launch = self.run.launch
        self.run.submit_s = self.exited_at - self.t0
        if self.proc.returncode != 0:
            self.run.error = (
                f"{os.path.basename(launch.argv[0])} exited {self.proc.returncode}: "
                f"{tail(launch.stderr) or tail(launch.stdout)}"
            )
            return False
        self.run.job_id = self.c.job_id(launch, launch.stdout.read_text(errors="replace"))
        if self.run.job_id is None:
            self.run.error = f"no job id in the launch command's output: {tail(launch.stdout)}"
            return False
        return True

    def look_for_running(self) -> bool:
        """squeue by name: record RUNNING; True when the job left squeue before running."""
        rows = job_rows(names=[self.run.launch.job_name])
        if rows is None:
            return False
        if not rows:
            if self.run.submit_s is not None:  # submitted, yet gone: it ended already
                self.run.error = "the job left squeue before it was seen RUNNING"
                return True
            return False
        row = next((r for r in rows if r.job_id == self.run.job_id), rows[0])
        if row.state == "RUNNING":
            self.run.running_s = self.since()
            self.run.node = row.node
            self.run.job_id = self.run.job_id or row.job_id
            self.next_live = time.monotonic() + LIVENESS_S
        return False

    def job_ended(self) -> bool:
        """After RUNNING: has the job ended without answering?"""
        self.next_live = time.monotonic() + LIVENESS_S
        rows = job_rows(names=[self.run.launch.job_name])
        if rows is None or any(r.state in ALIVE for r in rows):
            return False
        state = rows[0].state if rows else "gone from squeue"
        self.run.error = f"the job ended ({state}) before it answered"
        return True

    def timeout_message(self) -> str:
        run = self.run
        where = f"{self.endpoint[0]}:{self.endpoint[1]}" if self.endpoint else "not known"
        seen = [
            f"command returned: {'yes' if run.submit_s is not None else 'no'}",
            f"RUNNING: {'yes' if run.running_s is not None else 'no'}",
            f"server address: {where}",
        ]
        return f"no answer within {self.timeout_s:.0f} s ({', '.join(seen)})"

    def finish(self) -> None:
        """The launch command stopped if it still runs (a timeout, an interrupt)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # our own child's group
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.waiter is not None:
            self.waiter.join(timeout=5)


def stop_run(c: Contender, run: Run) -> None:
    """Stop the run's job; what is left in squeue afterwards goes into the run."""
    try:
        run.left_jobs = c.stop(run)
    except Exception as err:
        log(f"stopping {run.launch.job_name}: {type(err).__name__}: {err}")
        run.left_jobs = [run.job_id or run.launch.job_name]
    if run.left_jobs:
        log(f"WARNING: {run.launch.job_name}: still in squeue: {', '.join(run.left_jobs)}")


def one_run(
    c: Contender, tag: str, rnd: int, slot: int, timeout_s: float, launches: list[Launch]
) -> Run:
    """Prepare, launch and follow one contender; its job stopped however the run ends."""
    launch = c.prepare(tag)
    launches.append(launch)
    run = Run(launch=launch, round=rnd, slot=slot)
    try:
        Follow(c, run, timeout_s).go()
    except Exception as err:  # the harness, not the contender: recorded, the rounds go on
        run.error = run.error or f"{type(err).__name__}: {err}"
    finally:
        stop_run(c, run)
    what = f"first 200 after {run.first_200_s:.2f} s" if run.error is None else run.error
    log(f"{'warm-up' if rnd < 0 else f'round {rnd}'}: {LABELS[c.key]}: {what}")
    return run


def rotated(keys: list[str], rnd: int) -> list[str]:
    """The round's order: the contenders rotated by the round's number."""
    k = rnd % len(keys)
    return keys[k:] + keys[:k]


def measure(
    contenders: Mapping[str, Contender],
    rounds: int,
    timeout_s: float,
    tag: str,
    runs: list[Run],
    launches: list[Launch],
    warmup: str | None,
) -> None:
    """The warm-up run (one untimed launch of ``warmup``: the engine's files into the page
    cache), then ``rounds`` rounds of every contender, the order rotated each round. Runs go
    into ``runs`` as they end (an interrupted measurement keeps those)."""
    if warmup is not None:
        runs.append(one_run(contenders[warmup], f"{tag}-warm", -1, 0, timeout_s, launches))
    keys = list(contenders)
    for rnd in range(rounds):
        for slot, key in enumerate(rotated(keys, rnd)):
            runs.append(one_run(contenders[key], f"{tag}-r{rnd}", rnd, slot, timeout_s, launches))


def cancel_left(launches: list[Launch]) -> list[str]:
    """scancel every job still in squeue under the name of one of these launches (plain and
    vec-inf; xhpc's are its broker's to stop), then wait for them to leave; the ids left."""
    names = [la.job_name for la in launches if la.key != "xhpc"]
    if not names:
        return []
    rows = job_rows(names=names) or []
    if rows:
        log(f"cancelling jobs left: {', '.join(r.job_id for r in rows)}")
        scancel(r.job_id for r in rows)
    return wait_gone(names, GONE_TIMEOUT_S)
