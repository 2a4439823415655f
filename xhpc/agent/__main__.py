"""`python -m xhpc.agent REPLICA_DIR` — the process an xhpc sbatch job runs."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from xhpc.agent.agent import run_agent


def main() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s xhpc-agent %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if len(sys.argv) != 2:
        print("usage: python -m xhpc.agent REPLICA_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(run_agent(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
