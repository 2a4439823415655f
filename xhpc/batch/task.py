"""One shard of a batch, as one task of the batch's job array (``python -m xhpc.batch.task``).

The task serves the batch's model on its own GPUs with ``xhpc run-server`` (in-allocation
serving: its own key, answering on loopback), sends the shard's unanswered lines to it with a
few requests in flight, and appends each answer to the shard's progress file as it comes
(``xhpc.batch.lines``). Run again (requeued after a preemption, a node failure, a kill), it
reads that file back and sends only what is missing. SIGTERM (a cancel, a preemption) and
Slurm's warning before the time limit (SIGUSR1) stop it between answers: what was answered
is kept, what was in flight is sent again by the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp

from xhpc import runner
from xhpc.batch.lines import (
    BatchLine,
    ProgressFile,
    answered,
    parse_line,
    read_lines,
    refused,
    shard_range,
)
from xhpc.batch.spec import INPUT_FILE, SPEC_FILE, BatchSpec, progress_path
from xhpc.errors import EngineError

log = logging.getLogger(__name__)

Target = tuple[str, str | None, str]  # an engine: root URL, key, the name it serves under
READY_POLL_S = 0.1
SYNC_EVERY_S = 2.0
ATTEMPTS = 3  # a request whose connection failed is sent again this often


@contextlib.asynccontextmanager
async def serving(spec: BatchSpec, log_file: Path) -> AsyncIterator[Target]:
    """`xhpc run-server` for the batch's model; yields it as a target once it answers (the
    name it serves under is the engine's: transformers names a model by its path)."""
    private = Path(tempfile.mkdtemp(prefix="xhpc-batch-"))  # 0700: the ready and key files
    ready = private / "server.json"
    argv = [
        spec.python, "-m", "xhpc", "run-server", spec.model_path, "--name", spec.served_model,
        "--engine", spec.engine, "--gpus", str(spec.gpus), "--ready-file", str(ready),
        "--timeout", str(spec.startup_timeout_s),
    ]  # fmt: skip
    child = await runner.spawn(argv, env=dict(os.environ), output=log_file, cwd=private)
    try:
        while not ready.exists():
            if child.returncode is not None:
                raise EngineError(f"xhpc run-server exited with code {child.returncode}")
            await asyncio.sleep(READY_POLL_S)
        facts = json.loads(ready.read_text())
        key = Path(facts["key_file"]).read_text().strip()
        yield str(facts["base_url"]).removesuffix("/v1"), key, str(facts["model"])
    finally:
        await child.stop(grace_s=30)
        for leftover in private.iterdir():
            leftover.unlink(missing_ok=True)
        private.rmdir()


async def _send(session: aiohttp.ClientSession, target: Target, line: BatchLine) -> tuple[int, Any]:
    root, key, served = target
    body = {**(line.body or {}), "model": served}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for attempt in range(ATTEMPTS):
        try:
            async with session.post(f"{root}{line.url}", json=body, headers=headers) as resp:
                raw = await resp.read()
                try:
                    return resp.status, json.loads(raw)
                except json.JSONDecodeError:
                    return resp.status, {"error": {"message": raw[:2000].decode(errors="replace")}}
        except (aiohttp.ClientConnectionError, TimeoutError):
            if attempt == ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


async def answer_all(
    todo: list[BatchLine], targets: list[Target], progress: ProgressFile, spec: BatchSpec,
    stop: asyncio.Event, sent: Path,
) -> None:  # fmt: skip
    """Send ``todo`` with ``spec.concurrency`` in flight, spread over ``targets`` (engines:
    root URL, key, served name); each answer recorded as it comes. ``sent`` gets one byte per
    request sent: across runs, its size less the lines answered is the work a kill made the
    shard redo."""
    queue: asyncio.Queue[BatchLine] = asyncio.Queue()
    for line in todo:
        queue.put_nowait(line)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    loop = asyncio.get_running_loop()
    last_sync = loop.time()

    async with aiohttp.ClientSession(timeout=timeout) as session, _appending(sent) as tally:

        async def worker(target: Target) -> None:
            nonlocal last_sync
            while not stop.is_set():
                try:
                    line = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                tally.write(b".")
                tally.flush()
                status, body = await _send(session, target, line)
                if stop.is_set() and status >= 500:
                    return  # the engine is stopping with the task: the next run sends it
                progress.add(line.index, *answered(line, status, body))
                if loop.time() - last_sync > SYNC_EVERY_S:
                    last_sync = loop.time()
                    progress.sync()

        count = max(1, spec.concurrency)
        await asyncio.gather(*(worker(targets[i % len(targets)]) for i in range(count)))


def unanswered(
    lines: list[str], indexes: range, spec: BatchSpec, progress: ProgressFile
) -> list[BatchLine]:
    """The lines of ``indexes`` that ``progress`` does not hold; a malformed one is answered
    here, with its error line."""
    todo: list[BatchLine] = []
    for index in indexes:
        if index in progress.progress.done:
            continue
        line = parse_line(index, lines[index], spec.endpoint)
        if line.problem is not None:
            progress.add(index, False, refused(line))
        else:
            todo.append(line)
    return todo


@contextlib.asynccontextmanager
async def _appending(path: Path) -> AsyncIterator[BinaryIO]:
    with path.open("ab") as f:
        yield f


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
            server_log = batch_dir / "shards" / f"{shard}.server.log"
            async with serving(spec, server_log) as target:
                sent = batch_dir / "shards" / f"{shard}.sent"
                await answer_all(todo, [target], progress, spec, stop, sent)
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
