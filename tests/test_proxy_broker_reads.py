"""How the gateway reads a broker it does not trust (decision 0014): each answer at most so many
bytes (``xhpc.proxy.broker_call``), and its owner from the connection it came on.

A hostile member broker here is a thread of this process on a Unix socket that pads a valid
answer with megabytes of JSON whitespace; the socket swap is two stand-in brokers run as two
other Unix users (through ``setpriv``), one of which moves the other's socket onto its own path
while it answers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import needs_other_users
from tests.proxy_fakes import serve
from xhpc.access import Grants, ModelAccess
from xhpc.errors import BrokerError, BrokerUnavailableError
from xhpc.models import Route, RoutingTable
from xhpc.proxy import Router, broker_call, make_app
from xhpc.proxy.batch_api import batches
from xhpc.proxy.batch_api.batches import BatchFront, FileStore
from xhpc.proxy.source import BrokerRouteSource
from xhpc.proxy.tenants.keys import GrantSource, KeyBook

pytestmark = pytest.mark.security

MiB = 1024 * 1024
PYTHON = "/usr/bin/python3"
A_UID, B_UID = 4242, 4243


def table(version: int, model: str, rid: str) -> RoutingTable:
    route = Route(model=model, replica_id=rid, url="http://x.invalid", served_model=model)
    return RoutingTable(version=version, models=(model,), routes=(route,))


class PaddedBroker:
    """A 'broker' (a thread of this process) whose every answer is ``pad`` bytes of spaces and
    then a valid JSON answer, framed by Content-Length or chunked. ``sent``: the bytes each
    answer got out before its reader hung up."""

    def __init__(self, path: Path, answers: dict[str, bytes], pad: int, *, chunked: bool) -> None:
        self.answers, self.pad, self.chunked = answers, pad, chunked
        self.sent: list[int] = []
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                self.sent.append(self._answer(conn))

    def _answer(self, conn: socket.socket) -> int:
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        target = head.split(b" ")[1].decode()
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length:")), 0,
        )  # fmt: skip
        while len(body) < length:
            body += conn.recv(65536)
        payload = self.answers[target.split("?")[0]]
        total = self.pad + len(payload)
        framing = "Transfer-Encoding: chunked" if self.chunked else f"Content-Length: {total}"
        out = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
        block, sent = b" " * MiB, 0
        pieces = [block] * (self.pad // MiB) + [payload]
        try:
            sent += self._send(conn, out)
            for piece in pieces:
                framed = b"%x\r\n%s\r\n" % (len(piece), piece) if self.chunked else piece
                sent += self._send(conn, framed)
            if self.chunked:
                sent += self._send(conn, b"0\r\n\r\n")
        except OSError:  # the reader hung up
            pass
        return sent

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> int:
        view, done = memoryview(data), 0
        while done < len(data):
            done += conn.send(view[done:])
        return done


def authority_app() -> web.Application:
    """The first broker: a small, honest table and grants."""

    async def sync(_: web.Request) -> web.Response:
        return web.json_response(text=table(1, "a", "lab-0").model_dump_json())

    async def grants(_: web.Request) -> web.Response:
        access = (ModelAccess(model="a", owner="root"),)
        return web.json_response(text=Grants(access=access).model_dump_json())

    app = web.Application()
    app.router.add_post("/v1/proxy/sync", sync)
    app.router.add_post("/v1/proxy/grants", grants)
    return app


@pytest.mark.adversarial
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_member_brokers_huge_answer_stops_at_the_bound_and_is_its_failure(
    tmp_path: Path, chunked: bool
) -> None:
    """Failed on 6d94085 before the fix: the gateway read a broker's answer with no bound, so
    a member broker that padded its routing table and grants with 64 MiB of whitespace had
    every byte read, buffered and parsed (its model routed, its grants kept). Now an answer
    over 16 MiB is refused as it comes (at its Content-Length, or at the bound while a chunked
    body streams), never buffered whole, and counts as that broker's failure."""
    own, member = tmp_path / "own.sock", tmp_path / "member.sock"
    evil = Grants(access=(ModelAccess(model="evil", owner="root", account="acct"),))
    hostile = PaddedBroker(
        member,
        {
            "/v1/proxy/sync": table(9, "evil", "evil-0").model_dump_json().encode(),
            "/v1/proxy/grants": evil.model_dump_json().encode(),
        },
        64 * MiB,
        chunked=chunked,
    )
    router, book = Router(), KeyBook()
    routes = BrokerRouteSource([own, member], interval_s=3600)
    app = web.Application()
    GrantSource(own, book, 3600, routes).install(app)
    tracemalloc.start()
    try:
        async with serve(authority_app(), unix_path=own):
            async with routes:
                await routes.poll_once(router)
            runner = web.AppRunner(app)
            await runner.setup()  # the first grants sync
            await runner.cleanup()  # and the last
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        hostile.stop()
    bound = broker_call.MAX_ANSWER + 4 * MiB  # what the socket's buffers hold besides
    assert max(hostile.sent) < (4 * MiB if not chunked else bound), hostile.sent
    assert peak < (8 * MiB if not chunked else bound + 16 * MiB), peak
    assert len(hostile.sent) == 3  # one sync, two grants
    link = routes.links[1]
    assert router.knows("a") and not router.knows("evil")
    assert link.failures == 1 and link.table is None and routes.failures == 1
    assert link.access == () and book.access.get("evil") is None


async def test_the_batch_api_reads_at_most_its_bound_of_the_brokers_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's results come whole from the first broker: read up to ``MAX_BATCH_ANSWER``
    (lowered here), past which the client gets a 503 and nothing more is read."""
    monkeypatch.setattr(batches, "MAX_BATCH_ANSWER", 2 * MiB)
    sock = tmp_path / "b.sock"
    broker = PaddedBroker(sock, {"/v1/batches": b"[]"}, 32 * MiB, chunked=True)
    front = BatchFront(FileStore(tmp_path / "files"), sock, None)
    try:
        async with (
            serve(make_app(Router(), extra_routes=front.routes)) as url,
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/batches") as resp,
        ):
            status, body = resp.status, await resp.json()
    finally:
        broker.stop()
    assert status == 503 and body["error"]["code"] == "unavailable"
    assert broker.sent and max(broker.sent) < 6 * MiB, broker.sent


# --- the owner is the uid at the other end of the connection the table came on ---

SWAPPING = """\
import http.server, json, os, socketserver, sys

path, answers, swap_from = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if swap_from and os.path.exists(swap_from):
            os.rename(swap_from, path)  # another member's broker takes this path
        body = json.dumps(answers[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

with Server(path, Handler) as server:
    open(path + ".ready", "w").close()
    server.serve_forever()
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory two other uids may create and rename sockets in."""
    d = Path(tempfile.mkdtemp(prefix="xhpc-swap-", dir="/tmp"))
    d.chmod(0o777)
    (d / "stand_in.py").write_text(SWAPPING)
    (d / "stand_in.py").chmod(0o644)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def stand_in(
    d: Path, uid: int, sock: Path, answers: dict[str, object], swap_from: Path | None
) -> subprocess.Popen[bytes]:
    (d / f"answers-{uid}.json").write_text(json.dumps(answers))
    (d / f"answers-{uid}.json").chmod(0o644)
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", PYTHON]
    argv += [str(d / "stand_in.py"), str(sock), str(d / f"answers-{uid}.json")]
    proc = subprocess.Popen(
        [*argv, str(swap_from or "")], env={"HOME": "/tmp", "PATH": "/usr/bin:/bin"}
    )
    for _ in range(200):
        if Path(f"{sock}.ready").exists() or proc.poll() is not None:
            break
        await asyncio.sleep(0.05)
    assert proc.poll() is None, f"the stand-in broker of uid {uid} did not start"
    return proc


def answers(t: RoutingTable, grants: Grants) -> dict[str, object]:
    return {
        "/v1/proxy/sync": json.loads(t.model_dump_json()),
        "/v1/proxy/grants": json.loads(grants.model_dump_json()),
    }


@needs_other_users
@pytest.mark.adversarial
async def test_routes_belong_to_the_uid_that_sent_them_when_the_socket_is_swapped(
    open_dir: Path, tmp_path: Path
) -> None:
    """Failed on 6d94085 before the fix: the gateway read a member broker's routes on one
    connection and who runs it (SO_PEERCRED) on a second one, so a socket swapped in between
    (here: member A's broker moves member B's socket onto its own path while it answers) gave
    A's routes to B: A's model served as B's. Now the owner is the peer of the very connection
    the routes came on, and grants count only from that same uid."""
    path, b_sock = open_dir / "member.sock", open_dir / "b.sock"
    b_grants = Grants(access=(ModelAccess(model="m", owner="x", account="b-account"),))
    procs = [
        await stand_in(open_dir, B_UID, b_sock, answers(table(2, "m", "b-0"), b_grants), None),
        await stand_in(open_dir, A_UID, path, answers(table(1, "m", "a-0"), Grants()), b_sock),
    ]
    try:
        own = tmp_path / "own.sock"
        router, book = Router(), KeyBook()
        routes = BrokerRouteSource([own, path], interval_s=3600)
        app = web.Application()
        GrantSource(own, book, 3600, routes).install(app)
        async with serve(authority_app(), unix_path=own), routes:
            await routes.poll_once(router)
            assert not b_sock.exists()  # the swap happened while A answered
            link = routes.links[1]
            assert link.user == f"uid{A_UID}" and link.uid == A_UID
            assert router.route("a-0") is not None
            runner = web.AppRunner(app)
            await runner.setup()  # grants: B answers on the path now, as uid B_UID
            try:
                assert book.access["m"] == ModelAccess(model="m", owner=f"uid{A_UID}")
            finally:
                await runner.cleanup()
            # The next table comes from B: B's, as B's.
            await routes.poll_once(router)
            assert link.user == f"uid{B_UID}" and link.uid == B_UID
            assert router.route("b-0") is not None and router.route("a-0") is None
    finally:
        for proc in procs:
            proc.kill()  # this test's own stand-ins
            proc.wait(10)


# --- the client itself ---


async def test_a_call_answers_its_status_body_and_the_peer_uid(tmp_path: Path) -> None:
    async def teapot(_: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=418)

    app = web.Application()
    app.router.add_post("/x", teapot)
    async with serve(app, unix_path=tmp_path / "s.sock"):
        answer = await broker_call.call(tmp_path / "s.sock", "POST", "/x", b"{}", timeout_s=5)
    assert (answer.status, json.loads(answer.body)) == (418, {"error": "no"})
    assert answer.uid == os.getuid()
    with pytest.raises(BrokerUnavailableError, match="cannot reach the broker"):
        await broker_call.call(tmp_path / "none.sock", "GET", "/x", timeout_s=5)


@pytest.mark.parametrize(
    ("sent", "code"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", None),  # then it hangs up
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed_answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n" + b"x" * 32, "too"),
    ],
    ids=["cut", "malformed", "over-the-bound"],
)
async def test_a_cut_malformed_or_oversized_answer_is_an_error(
    tmp_path: Path, sent: bytes, code: str | None
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(sent)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(answer, str(tmp_path / "s.sock"))
    try:
        with pytest.raises(BrokerUnavailableError if code is None else BrokerError) as info:
            await broker_call.call(tmp_path / "s.sock", "GET", "/", timeout_s=5, max_bytes=16)
    finally:
        server.close()
        await server.wait_closed()
    if code == "too":
        assert info.value.code == "answer_too_large" and "limit is 16 bytes" in str(info.value)
    elif code is not None:
        assert info.value.code == code
    else:
        assert "closed before its answer ended" in str(info.value)
