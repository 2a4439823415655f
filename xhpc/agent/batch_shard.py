"""One shard of a batch, as one task of the batch's job array
(``python -m xhpc.agent.batch_shard BATCH_DIR``, the array task's id naming the shard).

The task serves the batch's model on its own GPUs as in-allocation serving does
(``xhpc.agent.local``: its own secret, answering on loopback), sends the shard's unanswered
lines to it with a few requests in flight (``xhpc.batch.send``), and appends each answer to the
shard's progress file as it comes. Run again (requeued after a preemption, a node failure, a
kill), it reads that file back and sends only what is missing. SIGTERM (a cancel, a
preemption) and Slurm's warning before the time limit (SIGUSR1) stop it between answers: what
was answered is kept, what was in flight is sent again by the next run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from xhpc.agent.local import local_engine
from xhpc.batch.lines import ProgressFile, read_lines, shard_range
from xhpc.batch.send import answer_all, unanswered
from xhpc.batch.spec import INPUT_FILE, SPEC_FILE, BatchSpec, progress_path
from xhpc.config import load_config

log = logging.getLogger(__name__)


async def run_shard(batch_dir: Path, shard: int) -> dict[str, int]:
    """Answer shard ``shard``'s lines that its progress file does not hold yet."""
    spec = BatchSpec.model_validate_json((batch_dir / SPEC_FILE).read_text())
    lines = read_lines(batch_dir / INPUT_FILE)
    progress = ProgressFile(progress_path(batch_dir, shard))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        todo = unanswered(lines, shard_range(len(lines), spec.shards, shard), spec, progress)
        log.info("shard %d: %d lines to answer", shard, len(todo))
        if todo:
            engine = local_engine(
                spec.model_path,
                load_config()[0],
                gpus=spec.gpus,
                engine=spec.engine,
                name=spec.served_model,
                timeout_s=spec.startup_timeout_s,
                log_file=batch_dir / "shards" / f"{shard}.engine.log",
            )
            await engine.start()
            try:
                # The name the engine serves under is its own (transformers: the path).
                target = (engine.url, engine.secret, engine.served_model)
                sent = batch_dir / "shards" / f"{shard}.sent"
                await answer_all(todo, [target], progress, spec, stop, sent)
            finally:
                await engine.stop()
    finally:
        progress.close()
    counts = {"completed": progress.progress.completed, "failed": progress.progress.failed}
    if stop.is_set():
        log.warning("shard %d stopped by a signal: %s", shard, counts)
        return {**counts, "stopped": 1}
    return counts


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    batch_dir = Path(sys.argv[1])
    shard = int(os.environ["SLURM_ARRAY_TASK_ID"])
    counts = asyncio.run(run_shard(batch_dir, shard))
    log.info("shard %d: %s", shard, counts)
    # Stopped with lines left: a non-zero exit, so a requeued run is not taken for done.
    return 3 if counts.get("stopped") else 0


if __name__ == "__main__":
    raise SystemExit(main())
