"""A batch's input, uploaded before the batch is created (``POST /v1/batch-inputs``).

The control API keeps small bodies (``xhpc.broker.api.MAX_CONTROL_BODY``); a batch's input is
the one large thing a caller sends, so it has an endpoint of its own that streams the body to
an owner-only file, ``<state_dir>/batch-inputs/<user>/<input id>.jsonl``, within
``broker.batch_input_max_bytes`` and ``broker.batch_input_max_lines``, never holding it whole
in memory. Each line is then checked to be JSON (in a thread: the event loop keeps serving),
and the caller gets the input's id, which ``POST /v1/batches`` names. Creating the batch moves
the file into the batch's directory; an input no batch took is removed after ``INPUT_TTL_S``,
and a user holds ``MAX_PENDING`` of them at most.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterable
from pathlib import Path

from xhpc.batch.lines import MAX_LINE_BYTES
from xhpc.errors import NotFoundError, ValidationError
from xhpc.ids import IdKind, new_input_id, valid
from xhpc.models import Frozen

CHUNK = 1 << 16
INPUT_TTL_S = 3600.0  # an input no batch took within this is removed
MAX_PENDING = 16  # inputs a user holds that no batch took yet
_SHOWN = 5


class BatchInput(Frozen):
    """An uploaded input: its id (what ``POST /v1/batches`` names), size and request lines."""

    id: str
    bytes: int
    lines: int


def scan(path: Path, max_lines: int) -> int:
    """The input's request lines (blank ones left out, as a batch does); ValidationError naming
    the first lines that are not JSON or are over ``MAX_LINE_BYTES``, or when there are more
    than ``max_lines`` of them (it stops there)."""
    bad: list[str] = []
    count = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            if count > max_lines:
                raise ValidationError(
                    f"the input is over the broker's limit of {max_lines} lines",
                    hint="split it into several batches",
                )
            if len(raw) > MAX_LINE_BYTES + 2:
                bad.append(f"{number} (over {MAX_LINE_BYTES} bytes)")
                continue
            try:
                json.loads(raw)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                bad.append(str(number))
        if bad:
            more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
            raise ValidationError(f"line {', '.join(bad[:_SHOWN])}{more} of the input: not JSON")
    if count == 0:
        raise ValidationError("the input file holds no requests")
    return count


class BatchInputs:
    """The uploaded inputs of every user, under ``root``."""

    def __init__(self, root: Path, max_bytes: int, max_lines: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_lines = max_lines

    def _dir(self, user: str) -> Path:
        if not valid(IdKind.NAME, user):
            raise ValidationError(f"no inputs for user {user[:80]!r}")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.root / user
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def _sweep(self, directory: Path) -> int:
        """Remove the user's inputs past INPUT_TTL_S; how many are left."""
        left = 0
        now = time.time()
        for path in directory.iterdir():
            try:
                if now - path.stat().st_mtime > INPUT_TTL_S:
                    path.unlink()
                elif path.suffix == ".jsonl":
                    left += 1
            except FileNotFoundError:
                continue
        return left

    async def receive(
        self, user: str, body: AsyncIterable[bytes], length: int | None = None
    ) -> BatchInput:
        """Stream ``body`` (``length``: its Content-Length, when sent) to a new input of
        ``user``; ValidationError, and nothing kept, when it is over a cap, empty or has a line
        that is not JSON."""
        over = f"the input is over the broker's limit of {self.max_bytes} bytes"
        if length is not None and length > self.max_bytes:
            raise ValidationError(over, hint="split it into several batches")
        directory = self._dir(user)
        if self._sweep(directory) >= MAX_PENDING:
            raise ValidationError(
                f"{MAX_PENDING} uploaded inputs wait for a batch already",
                hint=f"create batches from them, or wait {INPUT_TTL_S:.0f}s for them to expire",
            )
        input_id = new_input_id()
        part = directory / f".{input_id}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ValidationError(over, hint="split it into several batches")
                    f.write(chunk)
            lines = await asyncio.to_thread(scan, part, self.max_lines)
            os.replace(part, directory / f"{input_id}.jsonl")
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return BatchInput(id=input_id, bytes=size, lines=lines)

    def path(self, user: str, input_id: str) -> Path:
        """Where ``user``'s input ``input_id`` is; NotFoundError when it has no such input."""
        if not valid(IdKind.BATCH_INPUT, input_id):
            raise NotFoundError(f"no batch input {input_id[:80]!r}")
        path = self._dir(user) / f"{input_id}.jsonl"
        if not path.is_file():
            raise NotFoundError(
                f"no batch input {input_id!r} of {user}",
                hint="upload it first (POST /v1/batch-inputs); an unused one expires in "
                f"{INPUT_TTL_S:.0f}s",
            )
        return path

    def save(self, user: str, text: str) -> str:
        """A small input of ``user`` from a string, checked as an upload is; its id."""
        directory = self._dir(user)
        input_id = new_input_id()
        path = directory / f"{input_id}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            scan(path, self.max_lines)
        except ValidationError:
            path.unlink()
            raise
        return input_id
