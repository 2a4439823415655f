"""What the benchmarks that start their own processes share: a log line on stderr, a free
loopback port, the processes a run started (each leading its own process group, stopped by its
id, optionally dying with this process), an environment cleared of variables that would change
what a child does, SIGTERM as an exit that unwinds, and the last step of a run: print the table,
how long it took, and, with ``--json``, write the figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xhpc.agent import ports

ROOT = Path(__file__).resolve().parent.parent

_PR_SET_PDEATHSIG = 1


def logger(name: str) -> Callable[[str], None]:
    """A ``log(msg)`` that writes ``[bench/NAME] msg`` to stderr (stdout is for the table)."""

    def log(msg: str) -> None:
        print(f"[bench/{name}] {msg}", file=sys.stderr, flush=True)

    return log


def free_port() -> int:
    """A port free on every address, outside the kernel's ephemeral range (as the agent picks
    them): an engine's own port-0 sockets, started in between, never take it."""
    return ports.free_port()


def clean_env(drop: tuple[str, ...], **extra: str) -> dict[str, str]:
    """This process's environment without the variables whose names start with one of ``drop``,
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def wait(predicate: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(step_s)


def die_with_parent() -> None:
    """In the child before exec: killed when this process dies, even by SIGKILL (a CI timeout)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Procs:
    """The processes a run started, by name (unique); each leads its own process group, stopped
    by its id, its output in ``tmp/NAME.log``.

    ``die_with_parent``: each dies with this process (``PR_SET_PDEATHSIG``). ``stop`` sends
    SIGTERM to every chosen group (``newest_first`` or in start order), waits up to ``grace_s``
    in all, then SIGKILLs a group whose leader has not exited (and waits ``kill_wait_s`` for
    it); ``reap_groups``: every group gets a SIGKILL after its leader exited too (children that
    stay in the group, such as vLLM's EngineCore).
    """

    def __init__(
        self,
        tmp: Path,
        *,
        die_with_parent: bool = True,
        grace_s: float = 15.0,
        kill_wait_s: float = 5.0,
        reap_groups: bool = False,
        newest_first: bool = True,
    ) -> None:
        self.tmp = tmp
        self.die_with_parent = die_with_parent
        self.grace_s = grace_s
        self.kill_wait_s = kill_wait_s
        self.reap_groups = reap_groups
        self.newest_first = newest_first
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        core: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (under ``taskset -c CORE`` when ``core`` is given) in ROOT."""
        if core is not None:
            argv = ["taskset", "-c", str(core), *argv]
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if self.die_with_parent else None,  # no threads yet
            )
        finally:
            out.close()
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.tmp / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *names: str) -> None:
        """Stop the named processes, or all of them when none is named."""
        chosen = [(n, p) for n, p in self.procs.items() if not names or n in names]
        if self.newest_first:
            chosen.reverse()
        for _, proc in chosen:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # our own child's group
        deadline = time.monotonic() + self.grace_s
        for name, proc in chosen:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=self.kill_wait_s)
            if self.reap_groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            del self.procs[name]

    def tear_down(self, keep: bool, log: Callable[[str], None]) -> None:
        """Stop every process, then remove ``tmp`` (``keep``: leave it, and say where)."""
        self.stop()
        if keep:
            log(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(128 + 15): ``finally`` blocks stop what the run started."""

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)


@dataclass
class Summary:
    """The table a benchmark prints, and its figures (what ``--json`` writes)."""

    text: str
    data: dict[str, Any]


def target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    """One line per target under a table: ``MET  target: value`` or ``NOT MET target: value``."""
    return [f"{'MET ' if t['met'] else 'NOT MET'} {t['target']}: {t['value']}" for t in targets]


def emit(summary: Summary, t_start: float, json_path: Path | None, took: str = "") -> None:
    """Print the table and how long the run took (``took`` adds to that line); with ``--json``,
    write the figures there, with the run's seconds."""
    seconds = time.monotonic() - t_start
    print(summary.text)
    print(f"\n(run took {seconds:.1f}s{took})")
    if json_path:
        summary.data["seconds"] = seconds
        json_path.write_text(json.dumps(summary.data, indent=2))


def med(values: Sequence[float]) -> float:
    """The median of the measured values (NaN: not measured, skipped); NaN when none."""
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def spread(values: Sequence[float], scale: float = 1e3, digits: int = 1, sign: str = "") -> str:
    """``median [min, max]`` of the measured values times ``scale`` (default: seconds shown as
    ms), ``digits`` after the point (``sign="+"``: always signed); the median alone for one
    value, ``-`` for none."""
    vals = [v * scale for v in values if v == v]
    if not vals:
        return "-"
    m = statistics.median(vals)
    if len(vals) == 1:
        return f"{m:{sign}.{digits}f}"
    return f"{m:{sign}.{digits}f} [{min(vals):{sign}.{digits}f}, {max(vals):{sign}.{digits}f}]"


TINY_MODEL = ROOT / "models" / "tiny-llama"


def ensure_tiny_model(log: Callable[[str], None], model_dir: Path = TINY_MODEL) -> None:
    """Make the tiny model (scripts/make-tiny-model) when ``model_dir`` holds none yet."""
    if (model_dir / "config.json").exists():
        return
    log(f"making {model_dir} (scripts/make-tiny-model)")
    subprocess.run(
        [str(ROOT / "scripts" / "make-tiny-model"), str(model_dir)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def run_on_tiny_model(
    name: str,
    json_path: Path | None,
    run: Callable[[Path], dict[str, Any]],
    targets: Callable[[dict[str, Any]], list[dict[str, Any]]],
    table: Callable[[dict[str, Any]], str],
    model_dir: Path = TINY_MODEL,
) -> int:
    """A benchmark's whole run on the tiny model: SIGTERM unwinds, the model is made if need
    be, ``run`` gets a fresh work directory and returns the figures, which get their targets;
    the table is printed (and, with ``json_path``, the figures written)."""
    exit_on_sigterm()
    t0 = time.monotonic()
    ensure_tiny_model(logger(name), model_dir)
    import tempfile

    data = run(Path(tempfile.mkdtemp(prefix=f"xhpc-bench-{name}-")))
    data["targets"] = targets(data)
    emit(Summary(table(data), data), t0, json_path)
    return 0
