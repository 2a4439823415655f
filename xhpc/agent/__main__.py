"""`python -m xhpc.agent REPLICA_DIR` (one replica's job) or `--pilot PILOT_DIR` (a pilot job)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from xhpc.agent.agent import run_agent
from xhpc.agent.pilot import run_pilot

USAGE = "usage: python -m xhpc.agent REPLICA_DIR | --pilot PILOT_DIR"


def main() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s xhpc-agent %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--pilot":
        sys.exit(asyncio.run(run_pilot(Path(args[1]))))
    if len(args) != 1 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(run_agent(Path(args[0]))))


if __name__ == "__main__":
    main()
