"""The broker transport (xhpc/client/http.py) speaks HTTP/1.1 over the control socket itself:
what it sends, how it reads an answer (whole, chunked, cut short), and the errors it maps.

`serving` is a fake broker on a unix socket, also used by test_cli_ps.py and test_cli_lazy.py."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from xhpc.client.http import BrokerTransport, _parse
from xhpc.errors import (
    AdmissionError,
    BrokerError,
    BrokerUnavailableError,
    NotFoundError,
    ValidationError,
)

# An answer: (status, body); a callable gets the request (method, path, body) and returns one.
Answer = tuple[int, bytes]
Answers = dict[str, Answer] | Callable[[str, str, bytes], Answer]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    answers: Answers
    seen: list[tuple[str, str, dict[str, str], bytes]]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self.server.seen.append((self.command, self.path, dict(self.headers), body))
        answers = self.server.answers
        if callable(answers):
            status, payload = answers(self.command, self.path, body)
        else:
            not_found = b'{"error": {"code": "not_found", "message": "nothing here"}}'
            status, payload = answers.get(self.path, (404, not_found))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serving(state_dir: Path, answers: Answers) -> Iterator[_Server]:
    """A fake broker answering on ``state_dir``/broker.sock; ``.seen`` lists the requests."""
    state_dir.mkdir(parents=True, exist_ok=True)
    sock = state_dir / "broker.sock"
    server = _Server(str(sock), _Handler)
    server.answers, server.seen = answers, []
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, for every test.
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        sock.unlink()


def test_get_and_post(tmp_path: Path) -> None:
    def echo(method: str, path: str, body: bytes) -> Answer:
        return 200, json.dumps({"method": method, "path": path, "body": body.decode()}).encode()

    with serving(tmp_path, echo) as server:
        client = BrokerTransport(tmp_path / "broker.sock", timeout_s=10)
        assert client.get("/v1/replicas?all=1") == {
            "method": "GET", "path": "/v1/replicas?all=1", "body": ""
        }  # fmt: skip
        sent = json.dumps({"target": "modèle-ünï", "note": "日本"}, ensure_ascii=False)
        assert client.post("/v1/stop", sent)["body"] == sent  # UTF-8 on the wire
        assert client.alive()
    (_, _, get_headers, _), (_, _, post_headers, _), _ = server.seen
    assert get_headers["Connection"] == "close" and "Content-Length" not in get_headers
    assert post_headers["Content-Type"] == "application/json"
    assert int(post_headers["Content-Length"]) == len(sent.encode())


def test_a_large_answer_is_read_whole(tmp_path: Path) -> None:
    rows = [{"replica_id": f"r-{i}", "reason": "x" * 200} for i in range(2000)]  # ~0.5 MB
    with serving(tmp_path, {"/v1/replicas": (200, json.dumps(rows).encode())}):
        assert BrokerTransport(tmp_path / "broker.sock").get("/v1/replicas") == rows


@pytest.mark.parametrize(
    ("status", "error", "raised"),
    [
        (404, {"code": "not_found", "message": "no replica named 'x'"}, NotFoundError),
        (400, {"code": "invalid_request", "message": "bad"}, ValidationError),
        (400, {"code": "admission_failed", "message": "m", "problems": ["a", "b"]}, AdmissionError),
        (403, {"code": "forbidden", "message": "not yours"}, BrokerError),
        (500, {"code": "internal", "message": "boom"}, BrokerError),
    ],
)
def test_errors_are_mapped(
    tmp_path: Path, status: int, error: dict[str, Any], raised: type[Exception]
) -> None:
    body = json.dumps({"error": error}).encode()
    with serving(tmp_path, {"/v1/x": (status, body)}), pytest.raises(raised) as info:
        BrokerTransport(tmp_path / "broker.sock").get("/v1/x")
    assert type(info.value) is raised
    if isinstance(info.value, BrokerError):
        assert info.value.status == status and info.value.code == error["code"]


def test_not_json_is_a_broker_error(tmp_path: Path) -> None:
    answers: Answers = {"/v1/x": (500, b"500 Internal Server Error")}
    with serving(tmp_path, answers), pytest.raises(BrokerError, match="not JSON") as info:
        BrokerTransport(tmp_path / "broker.sock").get("/v1/x")
    assert info.value.status == 500


def test_no_broker(tmp_path: Path) -> None:
    with pytest.raises(BrokerUnavailableError, match="not running"):
        BrokerTransport(tmp_path / "broker.sock").get("/v1/replicas")
    assert not BrokerTransport(tmp_path / "broker.sock").alive()


@pytest.mark.parametrize("path", ["/v1/replicas/a b/logs", "/v1/x\r\nX-Evil: 1", "/v1/é"])
def test_a_path_that_is_no_request_path_is_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(ValidationError, match="not a request path"):
        BrokerTransport(tmp_path / "broker.sock").get(path)


def test_parse() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    assert _parse(head + b"Content-Length: 2\r\n\r\n{}") == (200, b"{}")
    assert _parse(head + b"content-length: 2\r\n\r\n{}trailing") == (200, b"{}")
    assert _parse(head + b"\r\n[1]") == (200, b"[1]")  # no length: to the end
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n3\r\n[1,\r\n2;x=y\r\n2]\r\n0\r\n\r\n"
    assert _parse(chunked) == (200, b"[1,2]")
    assert _parse(b"HTTP/1.0 404 Not Found\r\n\r\n") == (404, b"")
    for bad in (
        head + b"Content-Length: 10\r\n\r\n{}",  # cut short
        head + b"Transfer-Encoding: chunked\r\n\r\n9\r\n[1,\r\n",  # a chunk cut short
        head + b"Transfer-Encoding: chunked\r\n\r\n3\r\n[1,\r\n",  # no last chunk
        b"",  # nothing
        b"HTTP/1.1 200 OK\r\n",  # no end of head
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP
    ):
        with pytest.raises(ValueError):
            _parse(bad)


def test_an_answer_cut_short_is_unavailable(tmp_path: Path) -> None:
    def short(method: str, path: str, body: bytes) -> Answer:
        raise ConnectionResetError  # the handler dies: the connection closes with no answer

    unavailable = pytest.raises(BrokerUnavailableError, match="cannot talk to the broker")
    with serving(tmp_path, short), unavailable:
        BrokerTransport(tmp_path / "broker.sock").get("/v1/x")
