"""A client of two gateways (``[proxy] gateways``; xhpc.client.failover): the openai SDK's
client from the Python API sends to the first, and to the second when the first refuses the
connection or drops it mid-answer; the answers are the second gateway's, whole."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from xhpc.client.endpoint import Endpoint
from xhpc.client.failover import Rotation
from xhpc.gateway_settings import ProxyConfig, gateway_origin


def _completion(text: str) -> bytes:
    return json.dumps({
        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
    }).encode()  # fmt: skip


@contextmanager
def gateway(text: str, *, drop: bool = False) -> Iterator[tuple[str, list[str]]]:
    """A stand-in gateway on loopback answering every chat call with ``text`` (``drop``: it
    closes each connection before answering); yields its URL and the Host headers it saw."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            seen.append(self.headers.get("Host", ""))
            if drop:
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = _completion(text)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it closes


class Two(Endpoint):
    def __init__(self, first: str, second: str) -> None:
        self.base_url, self.fallbacks, self.api_key = f"{first}/v1", (f"{second}/v1",), "k"


def _ask(client: object) -> str:
    answer = client.chat.completions.create(  # type: ignore[attr-defined]
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    return str(answer.choices[0].message.content)


def test_a_refused_first_gateway_sends_the_call_to_the_second() -> None:
    dead = _closed_port()
    with gateway("from the second") as (url, seen):
        client = Two(dead, url).openai(max_retries=0)  # no SDK retry: the transport moved it
        assert _ask(client) == "from the second"
        assert _ask(client) == "from the second"
        assert seen == [url.removeprefix("http://")] * 2  # its own Host, not the first's


def test_a_first_gateway_that_dies_mid_answer_hands_the_retry_to_the_second() -> None:
    with gateway("never", drop=True) as (bad, dropped), gateway("whole") as (good, served):
        client = Two(bad, good).openai(max_retries=1)
        assert _ask(client) == "whole"  # the SDK's retry went to the second
        assert len(dropped) == 1 and len(served) == 1
        assert _ask(client) == "whole"  # and the second stays preferred
        assert len(dropped) == 1 and len(served) == 2


def test_the_async_client_falls_back_too() -> None:
    dead = _closed_port()
    with gateway("async") as (url, _):

        async def main() -> str:
            client = Two(dead, url).async_openai(max_retries=0)
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            await client.close()
            return str(answer.choices[0].message.content)

        assert asyncio.run(main()) == "async"


def test_every_gateway_refusing_is_one_connection_error() -> None:
    import openai

    client = Two(_closed_port(), _closed_port()).openai(max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        _ask(client)


def test_the_rotation_hands_the_preference_on_once() -> None:
    rotation = Rotation(["http://a:1/v1", "http://b:2", "http://c:3/"])
    assert rotation.order() == [0, 1, 2]
    rotation.failed(0)
    rotation.failed(0)  # a second failure of the same one moves nothing further
    assert rotation.order() == [1, 2, 0]
    assert rotation.origins[1] == ("http", "b", 2)


@pytest.mark.adversarial
@pytest.mark.parametrize(
    "url",
    [
        "ftp://a:1",
        "http://a",  # no port
        "http://user:pw@a:1",
        "http://a:1/v1/chat",
        "http://a:1?x=1",
        "http://a:99999",
        "http://a b:1",
        "http://a%0d:1",
        "https://:1",
    ],
)
def test_a_gateway_address_that_is_not_one_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not a gateway address"):
        gateway_origin(url)
    with pytest.raises(ValueError):
        ProxyConfig(gateways=(url,))


def test_the_gateways_setting_takes_addresses_once_each() -> None:
    cfg = ProxyConfig(gateways=("http://login1:8000", "https://[::1]:8443"))
    assert gateway_origin(cfg.gateways[1]) == ("https", "::1", 8443)
    with pytest.raises(ValueError, match="twice"):
        ProxyConfig(gateways=("http://a:1", "http://a:1"))
