"""Shared by the property tests (tests/test_properties_*.py): hostile strings, a reader of the
``#SBATCH`` lines of a job script held to xhpc.sbatch_values' allow-lists, and an event loop on
a thread of its own (a broker or a gateway served while hypothesis calls it synchronously)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import strategies as st

from tests.unit.test_broker_service import RecordingSlurm
from xhpc.broker.service import BrokerService
from xhpc.models import ReplicaState
from xhpc.sbatch_values import sbatch_problem

T = TypeVar("T")

# -- hostile values ------------------------------------------------------------------------------
# What a member tries in every field: the breakouts of an #SBATCH line (a quote, a backslash,
# a newline, '#', a leading '--'), shell syntax, NUL and other control characters, non-ASCII,
# dot segments and escapes, and lengths past every limit.
HOSTILE_WORDS = (
    "",
    " ",
    "'",
    '"',
    "\\",
    "\n",
    "\r\n",
    "\x00",
    "\t",
    "#",
    "--export=ALL",
    "-p",
    "x' --export=ALL #",
    'x\\" --wrap=id #',
    "gpu\n#SBATCH --export=ALL",
    "a b",
    "$(id)",
    "`id`",
    "a;b",
    "${HOME}",
    "..",
    "../../etc/passwd",
    "%2e%2e%2f",
    "/etc/passwd",
    "é",
    "n\u0131",
    "\u2028",
    "\x85",
    "\ufeff",
    "🙂",
    "x" * 64,
    "y" * 10_000,
    "UNLIMITED",
    "1-00:00:00",
    "\u0661:\u0660\u0660",  # Arabic-Indic digits: a regex's \d takes them
    "\uff11:00",  # a fullwidth digit
    "n[1-3],n7",
    "gpu",
    "a100",
)
HOSTILE_ALPHABET = st.sampled_from(list("aZ09._-,:@%+=/[]'\"\\\n\r\x00\t #$`;&|<>*?~é€\u2028🙂"))


def hostile_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """A string a hostile member would send: a known breakout, one built from the hostile
    alphabet, or any text at all."""
    return st.one_of(
        st.sampled_from(HOSTILE_WORDS),
        st.text(HOSTILE_ALPHABET, max_size=max_size),
        st.text(max_size=max_size),
    )


# -- #SBATCH lines -------------------------------------------------------------------------------
DIRECTIVE = "#SBATCH"
# The value of each option that takes a free value, by its kind in xhpc.sbatch_values.
KIND_OF = {
    "--job-name": "text",
    "--comment": "text",
    "--partition": "name",
    "--qos": "name",
    "--account": "name",
    "--time": "time",
    "--nodelist": "hostlist",
    "--output": "path",
}
# The values xhpc makes itself (numbers, its own fixed words).
FIXED = {
    "--nodes": re.compile(r"1"),
    "--ntasks": re.compile(r"1"),
    "--cpus-per-task": re.compile(r"[1-9][0-9]*"),
    "--mem": re.compile(r"[1-9][0-9]*M"),
    "--array": re.compile(r"0-[0-9]+"),
    "--signal": re.compile(r"B:USR1@[0-9]+"),
    "--open-mode": re.compile(r"append"),
    "--gres": re.compile(r"gpu:(?:(?P<type>[^:]+):)?[0-9]+"),
}
FLAGS = frozenset({"--requeue", "--no-requeue", "hetjob"})


def directives(script: str) -> list[tuple[str, str | None]]:
    """Every ``#SBATCH`` line of ``script`` as (option, value); None for a flag. Lines are
    split as Slurm splits them (on newlines only); a line that is not one whitespace-free
    option is returned whole as its option, for ``directive_problems`` to name."""
    found: list[tuple[str, str | None]] = []
    for line in script.split("\n"):
        if not line.startswith(DIRECTIVE):
            continue
        rest = line[len(DIRECTIVE) :]
        words = rest.split()
        if len(words) != 1 or rest != " " + words[0]:
            found.append((line, None))
            continue
        option, eq, value = words[0].partition("=")
        found.append((option, value if eq else None))
    return found


def directive_problems(script: str) -> list[str]:
    """Why ``script``'s ``#SBATCH`` lines are not what xhpc may write: a line that is not one
    option, an option xhpc never writes, a value outside its kind's allow-list, a directive
    after the first command (Slurm would ignore it), a carriage return."""
    problems: list[str] = []
    if "\r" in script:
        problems.append("a carriage return in the script")
    in_head = True
    for line in script.split("\n")[1:]:
        if line.startswith(DIRECTIVE) and not in_head:
            problems.append(f"a directive after the first command: {line!r}")
        if line.strip() and not line.startswith("#"):
            in_head = False
    for option, value in directives(script):
        if value is None:
            if option not in FLAGS:
                problems.append(f"not an option xhpc writes: {option!r}")
        elif option in KIND_OF:
            problem = sbatch_problem(KIND_OF[option], value, option)
            if problem is not None:
                problems.append(problem)
        elif option in FIXED:
            match = FIXED[option].fullmatch(value)
            if match is None:
                problems.append(f"{option}={value!r}")
            elif match.groupdict().get("type") is not None:
                problem = sbatch_problem("name", match.group("type"), "GPU type")
                if problem is not None:
                    problems.append(problem)
        else:
            problems.append(f"not an option xhpc writes: {option!r}")
    return problems


def options(script: str) -> dict[str, str | None]:
    """The options of a one-component script by name (a hetjob's repeat: use ``directives``)."""
    return dict(directives(script))


# -- a broker without a cluster --------------------------------------------------------------------
class CapturingSlurm(RecordingSlurm):
    """Records the text of every script it is asked to submit; submits nothing."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scripts: list[str] = []

    async def submit(self, script: Path) -> str:
        self.scripts.append(script.read_text())
        job_id = str(100 + len(self.submitted))
        self.submitted.append(job_id)
        return job_id


async def end_deployments(service: BrokerService, owner: str, keep: frozenset[str]) -> None:
    """``owner``'s live deployments but ``keep`` stopped and their jobs ended, as the reconcile
    loop would see them end: the next serve finds their GPUs and names free."""
    for dep in service.store.deployments():
        if dep.stopped_at is not None or dep.owner != owner or dep.name in keep:
            continue
        await service.stop(dep.name)
        for row in service.store.replicas(deployment=dep.name, active_only=True):
            service.lifecycle.move(row, ReplicaState.STOPPED, "its job ended")
        service.lifecycle.close_if_done(dep.name)


# -- an event loop on a thread of its own ----------------------------------------------------------
class BackgroundLoop:
    """An asyncio loop running on its own thread: what the broker or gateway under test is
    served from, while a synchronous hypothesis test calls it (over a socket, or through
    ``run`` for its state)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        """Every task left on the loop cancelled, then the loop stopped and closed."""

        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
