"""`xhpc top` through the CLI: a fake broker answers ``GET /v1/overview`` with the recorded
overview, a local HTTP server plays the proxy's /metrics; the terminal's mode is restored."""

from __future__ import annotations

import json
import os
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.unit.conftest import Run
from tests.unit.test_cli_client import serving
from xhpc.cli.observe.terminal import KeyReader
from xhpc.client.metrics import metrics_url
from xhpc.settings import ProxyConfig

TOP = Path(__file__).resolve().parent.parent / "data" / "top"
OVERVIEW = {"/v1/overview?events=10": (200, (TOP / "overview.json").read_bytes())}


@contextmanager
def proxy_metrics(status: int = 200) -> Iterator[str]:
    """A stand-in proxy: /metrics answers metrics-1.txt, then metrics-2.txt (10 s of traffic)."""
    bodies = [(TOP / "metrics-1.txt").read_bytes(), (TOP / "metrics-2.txt").read_bytes()]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.pop(0) if len(bodies) > 1 else bodies[0]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_once_prints_nodes_replicas_traffic_and_events(xhpc: Run, clean_env: Path) -> None:
    with serving(clean_env, OVERVIEW) as broker, proxy_metrics() as url:
        done = xhpc("top", "--once", "--interval", "0.2", "--metrics", url)
    assert done.code == 0, done.err
    assert [path for _, path, _, _ in broker.seen] == ["/v1/overview?events=10"]  # one call
    lines = done.out.splitlines()
    assert any("n1" in ln and "tiny-llama-0" in ln and "35%" in ln for ln in lines)
    assert any("tiny-llama-2" in ln and "QUEUED" in ln and "Resources" in ln for ln in lines)
    assert any(ln.startswith("tiny-llama ") and " 50 " in ln for ln in lines), done.out
    assert "READY: engine answered" in done.out and "[q] quit" not in done.out


def test_once_without_a_proxy_says_why_there_is_no_traffic(xhpc: Run, clean_env: Path) -> None:
    with serving(clean_env, OVERVIEW), proxy_metrics(status=401) as url:
        done = xhpc("top", "--once", "--metrics", url, "--filter", "llama-0")
    assert done.code == 0, done.err
    assert f"proxy traffic: {url} needs an admin key (HTTP 401)" in done.out
    assert "proxy.metrics_listen" in done.out
    # The filter: the deployment's header and its one matching replica; -2 nowhere.
    assert any(
        "tiny-llama-0" in ln and "READY" in ln and "in 17m59s" in ln for ln in done.out.splitlines()
    )
    assert "1/3 READY" in done.out and "tiny-llama-2" not in done.out


def test_json_carries_the_overview_and_the_traffic(xhpc: Run, clean_env: Path) -> None:
    with serving(clean_env, OVERVIEW), proxy_metrics() as url:
        done = xhpc("top", "--json", "--interval", "0.2", "--metrics", url)
    assert done.code == 0, done.err
    data = json.loads(done.out)
    assert data["overview"]["deployments"][0]["name"] == "tiny-llama"
    assert {t["model"]: t["requests_total"] for t in data["traffic"]} == {
        "qwen": 4,
        "tiny-llama": 50,
    }
    assert data["traffic_note"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "error: xhpc top needs a terminal; use --once or --json"),
        (("--once", "--interval", "0"), "invalid value for '--interval'"),
        (("--once", "--events", "500"), "invalid value for '--events'"),
    ],
)
def test_bad_input_is_one_line_and_asks_nothing(
    xhpc: Run, clean_env: Path, args: tuple[str, ...], message: str
) -> None:
    with serving(clean_env, OVERVIEW) as broker:
        done = xhpc("top", *args)
    assert done.code == 2 and message in done.err and done.out == ""
    assert broker.seen == []


def test_no_broker_is_one_line(xhpc: Run, clean_env: Path) -> None:
    done = xhpc("top", "--once", "--metrics", "http://127.0.0.1:1/metrics")
    assert done.code == 4 and done.err.startswith("error: the xhpc broker is not running")
    assert len(done.err.strip().splitlines()) == 1


def test_the_metrics_address_follows_the_proxy_config() -> None:
    assert metrics_url(ProxyConfig()) == "http://127.0.0.1:8000/metrics"
    assert metrics_url(ProxyConfig(host="0.0.0.0", port=9000)) == "http://127.0.0.1:9000/metrics"
    private = ProxyConfig(metrics_listen="[::1]:9100")
    assert metrics_url(private) == "http://[::1]:9100/metrics"
    assert metrics_url(ProxyConfig(port=0)) is None


def test_the_terminal_mode_is_restored_on_every_way_out() -> None:
    main, side = os.openpty()
    try:
        before = termios.tcgetattr(side)
        with pytest.raises(KeyboardInterrupt), KeyReader(side) as keys:
            assert not termios.tcgetattr(side)[3] & termios.ICANON  # keys without Enter
            os.write(main, b"/q")
            assert keys.read(1.0) == "/q"
            assert keys.read(0.0) == ""
            raise KeyboardInterrupt  # Ctrl-C
        assert termios.tcgetattr(side) == before
    finally:
        os.close(main)
        os.close(side)
