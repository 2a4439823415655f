"""The OpenAI Batch API on the proxy: ``/v1/files`` and ``/v1/batches`` for the openai SDK.

Files are kept per user (the key's user; the proxy's own user when keys are off) in owner-only
directories under ``<state_dir>/files/``, streamed there and bounded
(``xhpc.proxy.batch_api.files``). A batch is the broker's (``xhpc.broker.batches.batch_desk``):
``POST /v1/batches`` is admitted as a request of the key (rate, quota, a concurrency slot),
streams the input file to the broker's ``POST /v1/batch-inputs`` over its control socket and
asks it to create the batch for the key's user; retrieving, listing and cancelling ask it too.
Every call names that user and key (``xhpc.access.ACTING_USER_HEADER``): the broker acts as
them, never as the gateway, and checks ownership. Ids are checked (``xhpc.ids``) before any
call. A batch's model is the one its lines name (every line the same), and one the key may use
as in chat: a catalog model or a deployment of its user or account. ``metadata`` keys
``xhpc_shards``, ``xhpc_gpus``, ``xhpc_engine``, ``xhpc_qos``, ``xhpc_partition``,
``xhpc_time``, ``xhpc_concurrency``, ``xhpc_online`` (``true``: sent to the running replicas
of the deployment its lines name) choose how it runs. Once a batch
ended, its output and error files are ``file-out-BATCH`` and ``file-err-BATCH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from xhpc.access import ACTING_KEY_HEADER, ACTING_USER_HEADER, KeyGrant, may_use
from xhpc.errors import error_body
from xhpc.ids import RESULT_FILE_RE, Id, IdKind, control_path, valid
from xhpc.paths import reachable_socket
from xhpc.peers import user_name
from xhpc.proxy.batch_api.files import FileStore
from xhpc.proxy.errors import clipped
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KeyBook, KeyRefused
from xhpc.proxy.tenants.pacing import CallPacer
from xhpc.wire import WIRE_HEADER, WIRE_VERSION

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


async def _chunks(
    part: aiohttp.BodyPartReader, bytes_per_s: float | None = None
) -> AsyncIterator[bytes]:
    """A multipart part's bytes as they arrive, never whole; at ``bytes_per_s`` at most (the
    reading waits, and the client with it)."""
    start, seen = time.monotonic(), 0
    while chunk := await part.read_chunk(CHUNK_BYTES):
        seen += len(chunk)
        yield bytes(chunk)
        if bytes_per_s is not None:
            ahead = seen / bytes_per_s - (time.monotonic() - start)
            if ahead > 0:
                await asyncio.sleep(ahead)


async def _bounded(resp: aiohttp.ClientResponse) -> bytes:
    """The broker's answer, read up to ``MAX_BATCH_ANSWER`` bytes: ValueError past them (the
    rest is never read)."""
    data = bytearray()
    async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
        data += chunk
        if len(data) > MAX_BATCH_ANSWER:
            raise ValueError(f"the broker's answer is over {MAX_BATCH_ANSWER} bytes")
    return bytes(data)


async def _field(part: aiohttp.BodyPartReader) -> str:
    """A small form field's text (``purpose``); a long one is cut, not read whole."""
    data = bytearray()
    while (chunk := await part.read_chunk(CHUNK_BYTES)) and len(data) <= MAX_FIELD_BYTES:
        data += chunk
    return data[:MAX_FIELD_BYTES].decode(errors="replace").strip()


def models_in(f: BinaryIO, enough: int = 2) -> set[str]:
    """The models the lines of the input ``f`` name in their bodies, read line by line (in a
    thread) from its start; it stops at ``enough`` of them, and leaves ``f`` at its start again.
    A malformed line is left to the broker."""
    models: set[str] = set()
    f.seek(0)
    for raw in f:
        try:
            models.add(str(json.loads(raw)["body"]["model"]))
        except (ValueError, KeyError, TypeError):
            continue
        if len(models) >= enough:
            break
    f.seek(0)
    return models


def _options(metadata: dict[str, str]) -> dict[str, Any] | web.Response:
    """How the batch runs, from its ``xhpc_`` metadata keys; an error answer for a bad one."""
    options: dict[str, Any] = {OPTIONS[k]: v for k, v in metadata.items() if k in OPTIONS}
    for numeric in ("shards", "gpus", "concurrency"):
        if numeric in options:
            if not str(options[numeric]).isdigit():
                return _error(400, f"xhpc_{numeric} must be a whole number", "invalid_request")
            options[numeric] = int(options[numeric])
    if "online" in options:
        options["online"] = str(options["online"]).lower() in ("1", "true", "yes")
    return options


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


class Who:
    """Whom a gateway call acts for on the broker: the key's user and the key's id (no key:
    the gateway's own user, keys being off)."""

    __slots__ = ("key_id", "user")

    def __init__(self, user: str, key_id: str | None) -> None:
        self.user = user
        self.key_id = key_id

    def headers(self) -> dict[str, str]:
        headers = {ACTING_USER_HEADER: self.user, WIRE_HEADER: str(WIRE_VERSION)}
        if self.key_id is not None:
            headers[ACTING_KEY_HEADER] = self.key_id
        return headers


def _no_such(what: str) -> web.Response:
    return _error(404, f"no such {what}", "not_found")


class BatchFront:
    """The handlers; ``socket_path``: the broker that runs the batches.

    Every id from a client is checked against its rule (``xhpc.ids``) before anything else: a
    malformed one is a 404 and never reaches the broker. Calls to the broker are built with
    ``control_path`` and name the user they act for (its acting headers): the broker acts as
    that user, never as the gateway."""

    def __init__(
        self,
        files: FileStore,
        socket_path: Path,
        keys: KeyBook | None,
        router: Router | None = None,
        catalog: Collection[str] = (),
    ) -> None:
        """``router``: the gateway's routing table (its deployments); ``catalog``: the site's
        catalog model names."""
        self.files = files
        self.socket_path = socket_path
        self.keys = keys
        self.router = router
        self.catalog = frozenset(catalog)
        self.own_user = user_name(os.getuid())
        self._created: dict[str, list[float]] = {}  # user -> when their last batches were made
        self.pacer = CallPacer(files.limits.calls_per_s)

    def _grant(self, request: web.Request) -> KeyGrant | None:
        """The key's grant (KeyRefused without a valid key); None when keys are off."""
        return self.keys.identify(request.headers.get(hdrs.AUTHORIZATION)) if self.keys else None

    def _who(self, request: web.Request, grant: KeyGrant | None = None) -> Who:
        """The key's user (KeyRefused without a valid key), or the gateway's own user."""
        grant = grant or self._grant(request)
        who = Who(self.own_user, None) if grant is None else Who(grant.user, grant.key_id)
        if not valid(IdKind.NAME, who.user):
            raise KeyRefused(403, "this key's user cannot use batches", "forbidden")
        return who

    def _user(self, request: web.Request) -> str:
        return self._who(request).user

    async def _broker(
        self, method: str, path: str, who: Who, body: str | BinaryIO | None = None
    ) -> web.Response:
        """The broker's answer to ``method path`` (a ``control_path``), acting for ``who``;
        its errors as OpenAI's."""
        connector = aiohttp.UnixConnector(
            path=str(reachable_socket(self.socket_path)), force_close=True
        )
        timeout = aiohttp.ClientTimeout(total=60)
        url = URL("http://broker" + path, encoded=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                session.request(method, url, data=body, headers=who.headers()) as resp,
            ):
                data = json.loads(await _bounded(resp))
        except (aiohttp.ClientError, TimeoutError, ValueError):
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
                        pace = self.files.limits.upload_bytes_per_s
                        staged = await self.files.stage(user, _chunks(part, pace))
            except (ValueError, HttpProcessingError):
                # a form aiohttp cannot read: no boundary, a part's broken header, a cut body
                return _error(400, "the upload is not a well-formed multipart/form-data body",
                              "invalid_file")  # fmt: skip
            if purpose != "batch":
                return _error(400, f"purpose must be 'batch', not {clipped(purpose)!r}",
                              "invalid_purpose")  # fmt: skip
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
            return _no_such("file")
        return web.json_response(obj)

    async def file_content(self, request: web.Request) -> web.Response:
        who, file_id = self._who(request), request.match_info["file_id"]
        result = RESULT_FILE_RE.fullmatch(file_id)
        if result is not None:
            errors = int(result.group(1) == "err")
            batch = Id(IdKind.BATCH, result.group(2))
            path = control_path("v1", "batches", batch, "output", query={"errors": errors})
            answer = await self._broker("GET", path, who)
            if answer.status != 200:
                return answer
            text = json.loads(answer.text or "{}")["jsonl"]
            return web.Response(text=text, content_type="application/jsonl")
        data = self.files.content(who.user, file_id)
        if data is None:
            return _no_such("file")
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        user, file_id = self._user(request), request.match_info["file_id"]
        if not await asyncio.to_thread(self.files.delete, user, file_id):
            return _no_such("file")
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # -- batches ----------------------------------------------------------------------------
    def _deployment_ok(self, grant: KeyGrant | None, model: str) -> bool:
        """Whether ``model`` is a deployment the key may send a batch to: chat's rule
        (``xhpc.access.may_use``), except that an admin key is a member's here."""
        if self.keys is None or grant is None:
            return self.router is not None and model in self.router.table.models
        access = self.keys.access.get(model)
        return access is not None and may_use(grant.model_copy(update={"admin": False}), access)

    def _model_ok(self, grant: KeyGrant | None, model: str, online: bool) -> bool:
        """A job-array batch names a catalog model or a deployment the key may use; an
        online one, such a deployment. Never a path."""
        if not valid(IdKind.NAME, model):
            return False
        return (not online and model in self.catalog) or self._deployment_ok(grant, model)

    async def create_batch(self, request: web.Request) -> web.Response:
        """A batch is admitted as a request is (``KeyBook.admit``: the key's rate, its token
        quota; ``enter``: a concurrency slot while it is created); its tokens are counted for
        the key when it ends (by the broker, which keeps the key's id with the batch)."""
        keys = self.keys
        if keys is None:
            return await self._create_batch(request, None)
        grant = keys.admit(request.headers.get(hdrs.AUTHORIZATION))
        if not self._pace_batches(grant.user if grant is not None else self.own_user):
            return _error(429, f"too many batches created in a minute (at most "
                          f"{self.files.limits.batches_per_minute})", "rate_limited",
                          "rate_limit_error")  # fmt: skip
        hold = keys.enter(grant)
        try:
            return await self._create_batch(request, grant)
        finally:
            if hold is not None:
                keys.holds.release(hold)

    def _pace_batches(self, user: str) -> bool:
        """Whether ``user`` may create another batch this minute (``batches_per_minute``)."""
        most = self.files.limits.batches_per_minute
        if most is None:
            return True
        now = time.monotonic()
        recent = [t for t in self._created.get(user, ()) if now - t < 60.0]
        if len(recent) >= most:
            self._created[user] = recent
            return False
        self._created[user] = [*recent, now]
        return True

    async def _create_batch(self, request: web.Request, grant: KeyGrant | None) -> web.Response:
        """Stream the input file to the broker (its own upload endpoint: never read whole
        here), then create the batch there, for the key's user."""
        who = self._who(request, grant)
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON", "invalid_request")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request")
        file_id = str(body.get("input_file_id", ""))
        source = await asyncio.to_thread(self.files.open, who.user, file_id)
        if source is None:
            return _error(404, f"no input file {file_id[:80]!r}", "not_found")
        with source:  # aiohttp reads it in chunks, off the event loop
            return await self._create_from(grant, who, body, file_id, source)

    async def _create_from(
        self, grant: KeyGrant | None, who: Who, body: dict[str, Any], file_id: str,
        source: BinaryIO,
    ) -> web.Response:  # fmt: skip
        endpoint = str(body.get("endpoint", ""))
        metadata = {str(k): str(v) for k, v in (body.get("metadata") or {}).items()}
        options = _options(metadata)
        if isinstance(options, web.Response):
            return options
        models = await asyncio.to_thread(models_in, source)
        if len(models) != 1:
            return _error(400, "every line must name the same model in its body "
                          f"(found {sorted(models) or 'none'})", "invalid_request")  # fmt: skip
        model = models.pop()
        if not self._model_ok(grant, model, bool(options.get("online"))):
            # Another user's model is, to this key, a model that does not exist (as in chat).
            return _error(404, f"model {clipped(model)!r} does not exist", "model_not_found")
        uploaded = await self._broker("POST", control_path("v1", "batch-inputs"), who, source)
        if uploaded.status != 200:
            return uploaded
        request_body = {
            "model": model, "input_id": json.loads(uploaded.text or "{}")["id"],
            "endpoint": endpoint, "metadata": {**metadata, INPUT_ID: file_id}, **options,
        }  # fmt: skip
        path = control_path("v1", "batches")
        return self._as_batch(await self._broker("POST", path, who, json.dumps(request_body)))

    def _as_batch(self, answer: web.Response) -> web.Response:
        if answer.status != 200:
            return answer
        return web.json_response(batch_object(json.loads(answer.text or "{}")))

    def _batch_id(self, request: web.Request) -> Id | None:
        value = request.match_info["batch_id"]
        return Id(IdKind.BATCH, value) if valid(IdKind.BATCH, value) else None

    async def get_batch(self, request: web.Request) -> web.Response:
        who, batch = self._who(request), self._batch_id(request)
        if batch is None:
            return _no_such("batch")
        return self._as_batch(await self._broker("GET", control_path("v1", "batches", batch), who))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        who, batch = self._who(request), self._batch_id(request)
        if batch is None:
            return _no_such("batch")
        path = control_path("v1", "batches", batch, "cancel")
        return self._as_batch(await self._broker("POST", path, who, "{}"))

    async def list_batches(self, request: web.Request) -> web.Response:
        """The key's newest batches: ``limit`` of them (OpenAI's: 1 to 100, default 20)."""
        raw = request.query.get("limit", "20")
        if not (raw.isdigit() and 1 <= int(raw) <= 100):
            return _error(400, "limit must be a whole number from 1 to 100", "invalid_request")
        path = control_path("v1", "batches", query={"limit": int(raw) + 1})
        answer = await self._broker("GET", path, self._who(request))
        if answer.status != 200:
            return answer
        views = json.loads(answer.text or "[]")
        data = [batch_object(v) for v in views[: int(raw)]]
        return web.json_response(
            {"object": "list", "data": data, "has_more": len(views) > int(raw),
             "first_id": data[0]["id"] if data else None,
             "last_id": data[-1]["id"] if data else None}
        )  # fmt: skip

    def _paced(self, handler: Handler) -> Handler:
        """``handler`` at its user's turn (``CallPacer``): a call over the user's pace waits;
        one more than the pacer lets wait is refused."""

        async def paced(request: web.Request) -> web.StreamResponse:
            if not await self.pacer.turn(self._user(request)):
                return _error(429, "too many Files and Batch calls at once: slow down",
                              "rate_limited", "rate_limit_error")  # fmt: skip
            return await handler(request)

        return paced

    def routes(self, add: Callable[[str, str, Handler], None]) -> None:
        """Its endpoints, for ``make_app(extra_routes=...)``, each at its user's pace."""
        for method, path, handler in (
            ("POST", "/v1/files", self.upload),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{file_id}", self.get_file),
            ("DELETE", "/v1/files/{file_id}", self.delete_file),
            ("GET", "/v1/files/{file_id}/content", self.file_content),
            ("POST", "/v1/batches", self.create_batch),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{batch_id}", self.get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch),
        ):
            add(method, path, self._paced(handler))
