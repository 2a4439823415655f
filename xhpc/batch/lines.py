"""The OpenAI Batch API's file formats, and a shard's progress file (pure, on plain files).

Input: one request per line, ``{"custom_id", "method": "POST", "url", "body"}``. Output: one
line per request, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``, answered requests (2xx) in the output file and the rest (a refusal by the engine, a
malformed line) in the error file, each in input order.

A shard appends one record per finished input line to its progress file (``{"line": N, "ok":
bool, "out": <the output line>}``) and flushes it: that file is the shard's checkpoint. A
rerun of the shard (requeued, preempted, failed) reads it back, drops a torn last record (the
task was killed mid-write) and answers only the lines it does not hold, so every input line is
answered exactly once however often the shard ran. The broker reads each shard's file as it
grows (``ProgressReader``: only what was appended since its last read).

An uploaded input file is checked line by line as it arrives (``InputCheck``), before it is
kept.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINE_BYTES = 1 << 20  # one request line; OpenAI's own limit per file is far larger
MAX_TOKENS = 10**9  # one answer's stated usage beyond this is not believed


@dataclass(frozen=True)
class BatchLine:
    """Input line ``index`` (0-based): a request, or why it cannot be one (``problem``)."""

    index: int
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    problem: str | None = None


def parse_line(index: int, raw: str, endpoint: str) -> BatchLine:
    """One input line; never raises: a malformed line carries its problem."""
    if len(raw) > MAX_LINE_BYTES:
        return BatchLine(index, None, problem=f"line {index + 1} is over {MAX_LINE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        return BatchLine(index, None, problem=f"line {index + 1} is not JSON: {err.msg}")
    if not isinstance(data, dict):
        return BatchLine(index, None, problem=f"line {index + 1} is not a JSON object")
    cid = data.get("custom_id")
    custom_id = cid if isinstance(cid, str) and cid else None

    def bad(why: str) -> BatchLine:
        return BatchLine(index, custom_id, problem=f"line {index + 1}: {why}")

    if custom_id is None:
        return bad("custom_id must be a non-empty string")
    if data.get("method", "POST") != "POST":
        return bad("method must be POST")
    if data.get("url") != endpoint:
        return bad(f"url must be the batch's endpoint {endpoint}, not {data.get('url')!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object")
    if body.get("stream"):
        return bad("streaming is not supported in a batch")
    return BatchLine(index, custom_id, url=endpoint, body=body)


class InputCheck:
    """An uploaded input file checked as its bytes arrive (``feed``), a line at a time, so that
    the check keeps pace with the upload instead of reading the whole file once it is in.

    ``problem`` (once every byte was fed) says why the file cannot be a batch's input, naming
    its first bad line (1-based): a line over ``MAX_LINE_BYTES``, not UTF-8, not JSON or not a
    JSON object, or no request at all; None when every line is a JSON object. ``bad`` is that
    first problem as soon as it is seen (the rest need not be read)."""

    def __init__(self) -> None:
        self.lines = 0
        self.requests = 0
        self.bad: str | None = None
        self._tail = bytearray()  # the start of a line whose end has not arrived

    def feed(self, data: bytes | bytearray) -> None:
        if self.bad is not None:
            return
        self._tail += data
        start = 0
        while self.bad is None and (end := self._tail.find(b"\n", start)) >= 0:
            self._line(bytes(self._tail[start : end + 1]))
            start = end + 1
        del self._tail[:start]
        if self.bad is None and len(self._tail) > MAX_LINE_BYTES + 1:
            self.bad = f"line {self.lines + 1} is over {MAX_LINE_BYTES} bytes"

    def problem(self) -> str | None:
        if self.bad is None and self._tail:
            self._line(bytes(self._tail))
            self._tail.clear()
        if self.bad is None and not self.requests:
            self.bad = "the file holds no requests"
        return self.bad

    def _line(self, raw: bytes) -> None:
        self.lines += 1
        if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            self.bad = f"line {self.lines} is over {MAX_LINE_BYTES} bytes"
            return
        if not raw.strip():
            return  # blank lines are left out, as OpenAI does
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            self.bad = f"line {self.lines} is not UTF-8 text"
            return
        except json.JSONDecodeError as err:
            self.bad = f"line {self.lines} is not JSON: {err.msg}"
            return
        except RecursionError:
            self.bad = f"line {self.lines} is nested too deeply"
            return
        if not isinstance(data, dict):
            self.bad = f"line {self.lines} is not a JSON object"
            return
        self.requests += 1


def read_lines(path: Path) -> list[str]:
    """The input file's lines, blank ones left out (as OpenAI does)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        return [ln.rstrip("\n") for ln in f if ln.strip()]


def shard_range(total: int, shards: int, shard: int) -> range:
    """The input lines of ``shard``: contiguous, sizes differing by one at most."""
    return range(total * shard // shards, total * (shard + 1) // shards)


def duplicate_ids(lines: Iterable[str], endpoint: str) -> list[str]:
    seen: set[str] = set()
    dups: list[str] = []
    for i, raw in enumerate(lines):
        cid = parse_line(i, raw, endpoint).custom_id
        if cid is not None:
            if cid in seen and cid not in dups:
                dups.append(cid)
            seen.add(cid)
    return dups


def answered(line: BatchLine, status: int, body: Any) -> tuple[bool, dict[str, Any]]:
    """The output line for an engine's answer; ok: 2xx (the output file), else the error file."""
    ok = 200 <= status < 300
    error = None
    if not ok:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        error = {"code": "engine_error", "message": str(message or f"HTTP {status}")}
    return ok, {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": f"req_{secrets.token_hex(12)}",
            "body": body,
        },
        "error": error,
    }


def refused(line: BatchLine, code: str = "invalid_request", message: str = "") -> dict[str, Any]:
    """The error line of an input line that was not sent (malformed, or the engine failed)."""
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message or line.problem or "not sent"},
    }


@dataclass
class Progress:
    """What a shard's progress file holds: its finished lines and how they ended."""

    done: dict[int, bool]  # input line -> ok

    @property
    def completed(self) -> int:
        return sum(self.done.values())

    @property
    def failed(self) -> int:
        return len(self.done) - self.completed


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(end offset, record) of each whole record; stops at a torn one."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        offset = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                return
            offset += len(raw)
            yield offset, record


def read_progress(path: Path) -> Progress:
    """A shard's progress file read once, whole."""
    return ProgressReader(path).read()


class ProgressReader:
    """A shard's progress file read as it grows, for whoever reads it often (the broker, each
    reconcile): each ``read`` reads only the bytes appended since the last one, up to the last
    whole record (a record still being written is read the next time). A file that was cut
    (shorter, or the record read last is no longer where it was) or replaced (another inode) is
    read again from the start."""

    TAIL = 256  # bytes of the last record read, checked again before reading on

    def __init__(self, path: Path) -> None:
        self.path = path
        self.progress = Progress({})
        self.offset = 0  # the end of the last whole record read
        self.bytes_read = 0  # from the file, all reads together
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file read
        self._tail = b""  # the end of the last whole record read (it ends at ``offset``)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self.progress, self.offset, self._tail, self._identity = Progress({}), 0, b"", identity

    def _grew(self, st: os.stat_result) -> bool:
        """Whether there is more to read (restarted first if it is another file or shorter)."""
        if (st.st_dev, st.st_ino) != self._identity or st.st_size < self.offset:
            self._restart((st.st_dev, st.st_ino))
        return st.st_size > self.offset

    def read(self) -> Progress:
        try:
            if not self._grew(os.stat(self.path)):
                return self.progress  # nothing appended: the file is not opened
            f = self.path.open("rb")
        except FileNotFoundError:
            self._restart(None)
            return self.progress
        with f:
            if not self._grew(os.fstat(f.fileno())):
                return self.progress
            if self._tail:
                f.seek(self.offset - len(self._tail))
                tail = f.read(len(self._tail))
                self.bytes_read += len(tail)
                if tail != self._tail:  # cut and written again past where it was read
                    self._restart(self._identity)
            f.seek(self.offset)
            last = b""
            for raw in f:
                self.bytes_read += len(raw)
                if not raw.endswith(b"\n"):
                    break  # torn or still being written
                try:
                    record = json.loads(raw)
                    line, ok = int(record["line"]), bool(record["ok"])
                except (ValueError, KeyError, TypeError):
                    break  # as a torn record: nothing after it counts
                self.progress.done[line] = ok
                self.offset += len(raw)
                last = raw
            if last:
                self._tail = last[-self.TAIL :]
        return self.progress


class ProgressFile:
    """A shard's progress file, opened to append after its last whole record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        end = 0
        done: dict[int, bool] = {}
        for offset, record in _records(path):
            done[int(record["line"])] = bool(record["ok"])
            end = offset
        self.progress = Progress(done)
        if path.exists() and path.stat().st_size != end:
            with path.open("r+b") as f:
                f.truncate(end)  # a record torn by a kill: its line is answered again
        self._file = path.open("ab")

    def add(self, index: int, ok: bool, out: dict[str, Any]) -> None:
        record = {"line": index, "ok": ok, "out": out}
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        self.progress.done[index] = ok

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        self._file.close()


def _count(value: Any) -> int:
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else 0


def answered_usage(*result_files: Path) -> tuple[int, int, int]:
    """(requests, prompt tokens, completion tokens) of a batch's output and error files: the
    lines an engine answered, and the ``usage`` their answers state (what is not a count in
    range is 0)."""
    requests = prompt = completion = 0
    for path in result_files:
        with path.open("rb") as f:
            for raw in f:
                try:
                    response = json.loads(raw).get("response")
                except (ValueError, AttributeError):
                    continue
                if not isinstance(response, dict):
                    continue  # never sent: a malformed line
                requests += 1
                body = response.get("body")
                usage = body.get("usage") if isinstance(body, dict) else None
                if isinstance(usage, dict):
                    prompt += _count(usage.get("prompt_tokens"))
                    completion += _count(usage.get("completion_tokens"))
    return requests, prompt, completion


def assemble(progress_files: Iterable[Path], output: Path, errors: Path) -> tuple[int, int]:
    """The output and error files from the shards' progress files, in input order; a line
    answered twice (never, by construction) keeps its first answer. Returns (ok, failed)."""
    outs: dict[int, tuple[bool, dict[str, Any]]] = {}
    for path in progress_files:
        for _, record in _records(path):
            outs.setdefault(int(record["line"]), (bool(record["ok"]), record["out"]))
    ok_lines = [json.dumps(out) for _, (ok, out) in sorted(outs.items()) if ok]
    bad_lines = [json.dumps(out) for _, (ok, out) in sorted(outs.items()) if not ok]
    output.write_text("".join(f"{ln}\n" for ln in ok_lines))
    errors.write_text("".join(f"{ln}\n" for ln in bad_lines))
    return len(ok_lines), len(bad_lines)
