"""Sending a batch's lines to engines and recording each answer as it comes: what a shard's
task does with the engine it started (``xhpc.agent.batch_shard``), and what the broker does
with a deployment's running replicas (``--online`` batches, ``xhpc.broker.batches.batch_desk``).

Each answered line is appended to the shard's progress file (``xhpc.batch.lines``) before the
next is counted, so a sender stopped at any point (SIGKILL included) loses at most the requests
it had in flight; a stop event ends it between answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp

from xhpc.batch.lines import (
    BatchLine,
    ProgressFile,
    answered,
    parse_line,
    refused,
)
from xhpc.batch.spec import BatchSpec

log = logging.getLogger(__name__)

Target = tuple[str, str | None, str]  # an engine: root URL, key, the name it serves under
READY_POLL_S = 0.1
SYNC_EVERY_S = 2.0
ATTEMPTS = 3  # a request whose connection failed is sent again this often


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
