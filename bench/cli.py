"""How fast the CLI answers: `xhpc --help` and `xhpc ps` against an idle broker, beside the
interpreter's own start (docs/performance.md).

Starts a broker of its own (the packaged defaults, a fresh state directory, no deployment;
Slurm need not answer: `ps` reads the broker's store) and times, interleaved round by round
with the contenders' order rotated: A = ``python -c pass`` (the floor: the venv's
interpreter starting and exiting), B = ``python -c "import click"`` (a bare click CLI's
imports), C = ``xhpc --help``, D = ``xhpc ps`` (two control calls over the broker's socket).
Wall time of each process from spawn to exit, xhpc's modules byte-compiled (as installed);
median (min-max) over the rounds. Targets: C and D each <= 0.3 s.

    .venv/bin/python bench/cli.py [--rounds 15] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import Procs, Summary, emit, exit_on_sigterm, logger  # noqa: E402

log = logger("cli")
PYTHON = str(ROOT / ".venv" / "bin" / "python")
XHPC = str(ROOT / ".venv" / "bin" / "xhpc")
TARGET_S = 0.3
CONTENDERS: dict[str, list[str]] = {
    "python -c pass": [PYTHON, "-c", "pass"],
    "import click": [PYTHON, "-c", "import click"],
    "xhpc --help": [XHPC, "--help"],
    "xhpc ps": [XHPC, "ps"],
}
TARGETED = ("xhpc --help", "xhpc ps")


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}"
        )
    return took


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def measure(rounds: int, env: dict[str, str]) -> dict[str, list[float]]:
    names = list(CONTENDERS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: the page cache, the broker's first answer
        timed(CONTENDERS[name], env)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(CONTENDERS[name], env))
    return times


def summarize(times: dict[str, list[float]]) -> Summary:
    floor = statistics.median(times["python -c pass"])
    lines = [
        "| command | wall s, median (min-max) | minus the interpreter's start s | target |",
        "|---|---|---|---|",
    ]
    targets: list[dict[str, Any]] = []
    for name, values in times.items():
        med = statistics.median(values)
        goal = ""
        if name in TARGETED:
            met = med <= TARGET_S
            goal = f"<= {TARGET_S:g} s: {'met' if met else 'NOT met'}"
            targets.append(
                {"target": f"{name} <= {TARGET_S:g} s", "value": f"{med:.3f} s", "met": met}
            )
        lines.append(f"| {name} | {spread(values)} | {med - floor:+.3f} | {goal} |")
    data = {
        "median_s": {n: statistics.median(v) for n, v in times.items()},
        "rounds": len(times["xhpc ps"]),
        "targets": targets,
    }
    return Summary("\n".join(lines), data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the broker's state directory")
    args = ap.parse_args()
    exit_on_sigterm()
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-cli-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    # Byte-compiled as for any user: under PYTHONDONTWRITEBYTECODE (some shells and sandboxes set
    # it) every start would compile xhpc's modules again; the warm-up round writes them.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # The packaged defaults (no site config: nothing of the dev cluster's, whose bridge address
    # exists only while it is up) and a state directory of its own.
    env["XHPC_STATE_DIR"] = str(tmp / "state")
    procs = Procs(tmp)
    try:
        procs.start("broker", [XHPC, "broker"], env)
        deadline = time.monotonic() + 30
        while not (tmp / "state" / "broker.json").exists():  # written once it serves
            if time.monotonic() > deadline or procs.procs["broker"].poll() is not None:
                raise SystemExit(f"the broker did not start:\n{procs.log_tail('broker')}")
            time.sleep(0.05)
        log(f"broker up; {args.rounds} rounds of {len(CONTENDERS)} commands")
        summary = summarize(measure(args.rounds, env))
    finally:
        procs.tear_down(args.keep, log)
    emit(summary, t_start, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
