"""The two hostile tenants, in a process of their own (their client work is not the measured
client's): one key uploads a 64 MiB JSONL file through the gateway's Files API again and again
(deleting each once it is in), another floods files and batches.

    python -m bench._hostile.tenants SPEC    (SPEC: a JSON file, see ``Spec``; runs until SIGTERM)

Each flooding loop does, one call after another: upload a two-line file, create a batch of it
(``POST /v1/batches``: the broker submits a Slurm job array), cancel that batch at once, get it,
list the key's batches, list its files, delete the file. Its batches run the ``command`` engine
and ask for one minute, so a task that starts before its cancel costs little. On SIGTERM the
loops stop (what is in flight may finish within ``GRACE_S``), every batch whose cancel was not
answered is cancelled, every file still held is deleted, and the counts are written to the
spec's ``out`` file: per call, how many got 200, 429, another 4xx, a 5xx, or no answer.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

GRACE_S = 10.0
CHAT = "/v1/chat/completions"
FLOOD_METADATA = {"xhpc_engine": "command", "xhpc_time": "1"}
OPS = ("upload 64 MiB", "delete 64 MiB", "upload small", "create batch", "cancel batch",
       "get batch", "list batches", "list files", "delete file")  # fmt: skip


def request_line(custom_id: str, model: str, content: str) -> str:
    """One batch input line (JSON, no newline)."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def write_big(path: Path, size: int, line_bytes: int, model: str) -> int:
    """A valid batch input of exactly ``size`` bytes, ``line_bytes`` a line (newline included;
    ``size`` a multiple of it): request lines padded in their message. Its line count."""
    if size % line_bytes:
        raise ValueError(f"{size} is not a multiple of {line_bytes}")
    count = size // line_bytes
    bare = len(request_line(f"r{0:08d}", model, "")) + 1
    if bare > line_bytes:
        raise ValueError(f"a line needs {bare} bytes at least")
    pad = "x" * (line_bytes - bare)
    with path.open("w") as f:
        for i in range(count):
            f.write(request_line(f"r{i:08d}", model, pad) + "\n")
    return count


def status_class(status: int) -> str:
    if status == 0:
        return "failed"
    if status in (200, 429):
        return str(status)
    return "5xx" if status >= 500 else "4xx" if status >= 400 else str(status)


@dataclass
class Spec:
    url: str  # the gateway
    upload_key: str
    flood_key: str
    big_file: str
    model: str  # what the flood's batches name (a catalog model)
    flood_loops: int
    uploads: int  # 64 MiB uploads in flight at once
    ready: str  # written once the tenants run
    out: str  # the counts, written at the end


class Tenants:
    def __init__(self, spec: Spec, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self.session = session
        self.stop = asyncio.Event()
        self.counts: dict[str, dict[str, int]] = {op: {} for op in OPS}
        self.uploaded_bytes = 0
        self.batches: set[str] = set()  # created, cancel not answered yet
        self.files: dict[str, str] = {}  # file id -> its key: uploaded, not deleted yet
        self.serial = 0

    def _count(self, op: str, status: int) -> None:
        cls = status_class(status)
        self.counts[op][cls] = self.counts[op].get(cls, 0) + 1

    async def call(
        self, op: str | None, method: str, path: str, key: str, **kw: Any
    ) -> tuple[int, Any]:
        """(status, JSON answer or None); status 0 when no answer came."""
        headers = {"Authorization": f"Bearer {key}"}
        try:
            async with self.session.request(method, self.spec.url + path, headers=headers,
                                            **kw) as resp:  # fmt: skip
                data = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            status, data = 0, b""
        if op is not None:
            self._count(op, status)
        try:
            return status, json.loads(data) if status == 200 else None
        except ValueError:
            return status, None

    async def upload(self, op: str, key: str, name: str, content: bytes | Path) -> str | None:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        if isinstance(content, Path):
            with content.open("rb") as f:
                form.add_field("file", f, filename=name)
                status, obj = await self.call(op, "POST", "/v1/files", key, data=form)
        else:
            form.add_field("file", content, filename=name)
            status, obj = await self.call(op, "POST", "/v1/files", key, data=form)
        if status != 200 or obj is None:
            return None
        self.files[obj["id"]] = key
        return str(obj["id"])

    async def delete(self, op: str | None, file_id: str) -> None:
        key = self.files[file_id]
        status, _ = await self.call(op, "DELETE", f"/v1/files/{file_id}", key)
        if status in (200, 404):
            self.files.pop(file_id, None)

    async def cancel(self, op: str | None, batch_id: str) -> None:
        status, _ = await self.call(op, "POST", f"/v1/batches/{batch_id}/cancel",
                                    self.spec.flood_key)  # fmt: skip
        if status == 200:
            self.batches.discard(batch_id)

    async def uploader(self) -> None:
        big = Path(self.spec.big_file)
        while not self.stop.is_set():
            file_id = await self.upload("upload 64 MiB", self.spec.upload_key, "big.jsonl", big)
            if file_id is None:
                await asyncio.sleep(0.1)  # refused (a limit): try again, not in a tight loop
                continue
            self.uploaded_bytes += big.stat().st_size
            await self.delete("delete 64 MiB", file_id)

    async def flooder(self) -> None:
        key = self.spec.flood_key
        while not self.stop.is_set():
            self.serial += 1
            n = self.serial
            lines = [request_line(f"f{n}-{i}", self.spec.model, "hi") for i in range(2)]
            file_id = await self.upload("upload small", key, f"f{n}.jsonl",
                                        ("\n".join(lines) + "\n").encode())  # fmt: skip
            if file_id is None:
                await asyncio.sleep(0.1)
                continue
            body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h",
                    "metadata": FLOOD_METADATA}  # fmt: skip
            status, batch = await self.call("create batch", "POST", "/v1/batches", key, json=body)
            if status == 200 and batch is not None:
                self.batches.add(batch["id"])
                await self.cancel("cancel batch", batch["id"])
                await self.call("get batch", "GET", f"/v1/batches/{batch['id']}", key)
            await self.call("list batches", "GET", "/v1/batches", key)
            await self.call("list files", "GET", "/v1/files", key)
            await self.delete("delete file", file_id)

    async def run(self) -> dict[str, Any]:
        t0, cpu0 = time.monotonic(), time.process_time()
        loops = [asyncio.create_task(self.uploader()) for _ in range(self.spec.uploads)]
        loops += [asyncio.create_task(self.flooder()) for _ in range(self.spec.flood_loops)]
        Path(self.spec.ready).write_text("running\n")
        await self.stop.wait()
        seconds, cpu_s = time.monotonic() - t0, time.process_time() - cpu0
        _, late = await asyncio.wait(loops, timeout=GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        left = {"batches": len(self.batches), "files": len(self.files)}
        for batch_id in sorted(self.batches):  # cleaning up: not counted
            await self.cancel(None, batch_id)
        for file_id in sorted(self.files):
            await self.delete(None, file_id)
        return {
            "seconds": seconds,
            "cpu_s": cpu_s,
            "uploaded_bytes": self.uploaded_bytes,
            "ops": self.counts,
            "left_at_stop": left,
            "not_cleaned": {"batches": sorted(self.batches), "files": sorted(self.files)},
        }


async def main(spec: Spec) -> None:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tenants = Tenants(spec, session)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, tenants.stop.set)
        loop.add_signal_handler(signal.SIGINT, tenants.stop.set)
        result = await tenants.run()
    Path(spec.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main(Spec(**json.loads(Path(sys.argv[1]).read_text()))))
