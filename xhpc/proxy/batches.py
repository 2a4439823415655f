"""The OpenAI Batch API on the proxy: ``/v1/files`` and ``/v1/batches`` for the openai SDK.

Files are kept per user (the key's user; the proxy's own user when keys are off) in owner-only
directories under ``<state_dir>/files/``, streamed there and bounded (``xhpc.proxy.files``).
A batch is the broker's (``xhpc.broker.batch_desk``):
``POST /v1/batches`` reads the input file and asks the broker, over its control socket, to
create the batch for the key's user; retrieving, listing and cancelling ask it too, naming that
user, and the broker checks ownership. A batch's model is the one its lines name (every line
the same). ``metadata`` keys ``xhpc_shards``, ``xhpc_gpus``, ``xhpc_engine``, ``xhpc_qos``,
``xhpc_partition``, ``xhpc_time``, ``xhpc_concurrency``, ``xhpc_online`` (``true``: sent to
the running replicas of the deployment its lines name) choose how it runs. Once a batch
ended, its output and error files are ``file-out-BATCH`` and ``file-err-BATCH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import hdrs, web

from xhpc.errors import BrokerError, BrokerUnavailableError, error_body
from xhpc.peers import user_name
from xhpc.proxy import broker_call
from xhpc.proxy.files import FileStore
from xhpc.proxy.keys import KeyBook

RESULT_ID_RE = re.compile(r"^file-(out|err)-(batch_[0-9a-f]{24})$")
OPTIONS = {"xhpc_shards": "shards", "xhpc_gpus": "gpus", "xhpc_engine": "engine",
           "xhpc_qos": "qos", "xhpc_partition": "partition", "xhpc_time": "time",
           "xhpc_concurrency": "concurrency", "xhpc_online": "online"}  # fmt: skip
INPUT_ID = "xhpc_input_file_id"
# A batch's results come whole in one JSON answer: read at most this much of it.
MAX_BATCH_ANSWER = 512 * 1024 * 1024
CHUNK_BYTES = 1 << 16  # an upload is read in chunks of this
MAX_FIELD_BYTES = 256  # a form field other than the file (its purpose)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(
    status: int, message: str, code: str, type_: str = "invalid_request_error"
) -> web.Response:
    return web.json_response(error_body(message, type_=type_, code=code), status=status)


async def _chunks(part: aiohttp.BodyPartReader) -> AsyncIterator[bytes]:
    """A multipart part's bytes as they arrive, never whole."""
    while chunk := await part.read_chunk(CHUNK_BYTES):
        yield bytes(chunk)


async def _field(part: aiohttp.BodyPartReader) -> str:
    """A small form field's text (``purpose``); a long one is cut, not read whole."""
    data = bytearray()
    while (chunk := await part.read_chunk(CHUNK_BYTES)) and len(data) <= MAX_FIELD_BYTES:
        data += chunk
    return data[:MAX_FIELD_BYTES].decode(errors="replace").strip()


def batch_object(view: dict[str, Any]) -> dict[str, Any]:
    """The broker's view of a batch as OpenAI's batch object."""
    meta = dict(view.get("metadata") or {})
    ended = view.get("output_file") is not None
    errors = [{"code": "batch_failed", "message": m, "param": None, "line": None}
              for m in view.get("errors") or []]  # fmt: skip
    return {
        "id": view["id"],
        "object": "batch",
        "endpoint": view["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": meta.pop(INPUT_ID, ""),
        "completion_window": "24h",
        "status": view["status"],
        "output_file_id": f"file-out-{view['id']}" if ended else None,
        "error_file_id": f"file-err-{view['id']}" if ended else None,
        "created_at": view["created_at"],
        "in_progress_at": view["created_at"],
        "completed_at": view.get("completed_at"),
        "cancelled_at": view.get("cancelled_at"),
        "request_counts": view["request_counts"],
        "metadata": {k: v for k, v in meta.items() if k not in OPTIONS} or None,
        "model": view.get("model"),
    }


class BatchFront:
    """The handlers; ``socket_path``: the broker that runs the batches."""

    def __init__(self, files: FileStore, socket_path: Path, keys: KeyBook | None) -> None:
        self.files = files
        self.socket_path = socket_path
        self.keys = keys
        self.own_user = user_name(os.getuid())

    def _user(self, request: web.Request) -> str:
        """The key's user (KeyRefused without a valid key), URL-quoted for the broker."""
        grant = self.keys.identify(request.headers.get(hdrs.AUTHORIZATION)) if self.keys else None
        return quote(grant.user if grant is not None else self.own_user, safe="")

    async def _broker(self, method: str, path: str, body: str | None = None) -> web.Response:
        """The broker's answer (at most ``MAX_BATCH_ANSWER`` bytes), its errors as OpenAI's."""
        sent = None if body is None else body.encode()
        try:
            resp = await broker_call.call(
                self.socket_path, method, path, sent, timeout_s=60, max_bytes=MAX_BATCH_ANSWER
            )
            data = json.loads(resp.body)
        except (BrokerUnavailableError, BrokerError, ValueError):
            return _error(503, "the broker that runs batches is not answering", "unavailable",
                          "server_error")  # fmt: skip
        if resp.status != 200:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            status = resp.status if resp.status in (400, 403, 404) else 502
            return _error(status, str(err.get("message", "the broker refused")),
                          str(err.get("code", "broker_error")))  # fmt: skip
        return web.json_response(data)

    # -- files ------------------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        """A file streamed to the user's directory as it arrives (``FileStore.stage``), then
        checked and kept (``commit``); refused past a limit, with nothing of it kept."""
        user = self._user(request)
        if not request.content_type.startswith("multipart/"):
            return _error(400, "upload a file as multipart/form-data", "invalid_request")
        purpose, filename, staged = "", "upload.jsonl", None
        try:
            async for part in await request.multipart():
                if not isinstance(part, aiohttp.BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = await _field(part)
                    if purpose != "batch":
                        break
                elif part.name == "file":
                    if staged is not None:
                        return _error(400, "upload one file at a time", "invalid_file")
                    filename = part.filename or filename
                    staged = await self.files.stage(user, _chunks(part))
            if purpose != "batch":
                return _error(400, f"purpose must be 'batch', not {purpose!r}", "invalid_purpose")
            if staged is None:
                return _error(400, "the file is empty or missing", "invalid_file")
            return web.json_response(await self.files.commit(staged, filename, purpose))
        finally:
            if staged is not None:
                self.files.discard(staged)

    async def list_files(self, request: web.Request) -> web.Response:
        files = await asyncio.to_thread(self.files.all, self._user(request))
        return web.json_response({"object": "list", "data": files})

    async def get_file(self, request: web.Request) -> web.Response:
        user, file_id = self._user(request), request.match_info["file_id"]
        obj = await asyncio.to_thread(self.files.meta, user, file_id)
        if obj is None:
            return _error(404, "no such file", "not_found")
        return web.json_response(obj)

    async def file_content(self, request: web.Request) -> web.Response:
        user, file_id = self._user(request), request.match_info["file_id"]
        result = RESULT_ID_RE.fullmatch(file_id)
        if result is not None:
            errors = int(result.group(1) == "err")
            path = f"/v1/batches/{result.group(2)}/output?errors={errors}&owner={user}"
            answer = await self._broker("GET", path)
            if answer.status != 200:
                return answer
            text = json.loads(answer.text or "{}")["jsonl"]
            return web.Response(text=text, content_type="application/jsonl")
        data = self.files.content(user, file_id)
        if data is None:
            return _error(404, "no such file", "not_found")
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        user, file_id = self._user(request), request.match_info["file_id"]
        if not await asyncio.to_thread(self.files.delete, user, file_id):
            return _error(404, "no such file", "not_found")
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # -- batches ----------------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        user = self._user(request)
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON", "invalid_request")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request")
        file_id, endpoint = str(body.get("input_file_id", "")), str(body.get("endpoint", ""))
        data = self.files.content(user, file_id)
        if data is None:
            return _error(404, f"no input file {file_id!r}", "not_found")
        metadata = {str(k): str(v) for k, v in (body.get("metadata") or {}).items()}
        models = set()
        for raw in data.decode(errors="replace").splitlines():
            try:
                line = json.loads(raw)
                models.add(str(line["body"]["model"]))
            except (ValueError, KeyError, TypeError):
                continue  # a malformed line gets its own error line in the batch
        if len(models) != 1:
            return _error(400, "every line must name the same model in its body "
                          f"(found {sorted(models) or 'none'})", "invalid_request")  # fmt: skip
        options: dict[str, Any] = {OPTIONS[k]: v for k, v in metadata.items() if k in OPTIONS}
        for numeric in ("shards", "gpus", "concurrency"):
            if numeric in options:
                if not str(options[numeric]).isdigit():
                    return _error(400, f"xhpc_{numeric} must be a whole number", "invalid_request")
                options[numeric] = int(options[numeric])
        if "online" in options:
            options["online"] = str(options["online"]).lower() in ("1", "true", "yes")
        request_body = {
            "model": models.pop(), "input": data.decode(errors="replace"), "endpoint": endpoint,
            "metadata": {**metadata, INPUT_ID: file_id}, "owner": user, **options,
        }  # fmt: skip
        answer = await self._broker("POST", "/v1/batches", json.dumps(request_body))
        return self._as_batch(answer)

    def _as_batch(self, answer: web.Response) -> web.Response:
        if answer.status != 200:
            return answer
        return web.json_response(batch_object(json.loads(answer.text or "{}")))

    async def get_batch(self, request: web.Request) -> web.Response:
        batch_id, user = request.match_info["batch_id"], self._user(request)
        return self._as_batch(await self._broker("GET", f"/v1/batches/{batch_id}?owner={user}"))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch_id, user = request.match_info["batch_id"], self._user(request)
        path = f"/v1/batches/{batch_id}/cancel?owner={user}"
        return self._as_batch(await self._broker("POST", path, "{}"))

    async def list_batches(self, request: web.Request) -> web.Response:
        answer = await self._broker("GET", f"/v1/batches?owner={self._user(request)}")
        if answer.status != 200:
            return answer
        data = [batch_object(v) for v in json.loads(answer.text or "[]")]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    def routes(self, add: Callable[[str, str, Handler], None]) -> None:
        """Its endpoints, for ``make_app(extra_routes=...)``."""
        add("POST", "/v1/files", self.upload)
        add("GET", "/v1/files", self.list_files)
        add("GET", "/v1/files/{file_id}", self.get_file)
        add("DELETE", "/v1/files/{file_id}", self.delete_file)
        add("GET", "/v1/files/{file_id}/content", self.file_content)
        add("POST", "/v1/batches", self.create_batch)
        add("GET", "/v1/batches", self.list_batches)
        add("GET", "/v1/batches/{batch_id}", self.get_batch)
        add("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch)
