"""run_probe against a real aiohttp server on 127.0.0.1: token, recovery after a move, stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from xhpc.errors import BrokerUnavailableError
from xhpc.models import ProbeReport
from xhpc.probe.fake import FakeBackend
from xhpc.probe.runner import PROBE_PATH, read_agent_url, run_probe

TOKEN = "node-token-s3cr3t-value"


class Broker:
    """The agent API's probe endpoint, recording what arrives."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.reports: list[ProbeReport] = []
        self.auth: list[str] = []
        self.arrived = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _probe(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization", ""))
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        self.reports.append(ProbeReport.model_validate_json(await request.text()))
        self.arrived.set()
        return web.json_response({"status": "ok"})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PROBE_PATH, self._probe)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    b = Broker()
    await b.start()
    yield b
    await b.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def point(broker_file: Path, url: str) -> None:
    tmp = broker_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"agent_url": url, "pid": 1}))
    os.replace(tmp, broker_file)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def no_token_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


async def test_posts_a_valid_report_with_the_bearer_token(
    broker: Broker, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker_file = tmp_path / "broker.json"
    point(broker_file, broker.url + "/")
    delivered = await run_probe(
        "node-1", FakeBackend(gpus=2), broker_file, token_file, interval_s=60, once=True
    )
    assert delivered == 1
    assert broker.auth == [f"Bearer {TOKEN}"]
    (report,) = broker.reports
    assert report.node == "node-1" and report.backend == "fake" and len(report.gpus) == 2
    no_token_in_logs(caplog)


async def test_recovers_when_the_address_file_moves_to_a_live_broker(
    broker: Broker, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="xhpc.probe")
    broker_file = tmp_path / "broker.json"
    point(broker_file, dead_url())
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_probe(
            "node-1", FakeBackend(gpus=1), broker_file, token_file, interval_s=0.05, stop=stop
        )
    )
    for _ in range(200):  # a few failed reports against the dead port
        if sum("report failed again" in r.getMessage() for r in caplog.records) >= 2:
            break
        await asyncio.sleep(0.02)
    assert not broker.reports
    point(broker_file, broker.url)  # the broker restarted elsewhere
    await asyncio.wait_for(broker.arrived.wait(), 10)
    stop.set()
    delivered = await asyncio.wait_for(task, 10)
    assert delivered >= 1 and len(broker.reports) == delivered
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "an outage is logged once"
    assert "cannot report to the broker" in warnings[0].getMessage()
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    no_token_in_logs(caplog)


async def test_no_address_file_yet_is_an_outage_not_a_crash(
    token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(BrokerUnavailableError, match="no broker address"):
        await run_probe(
            "node-1", FakeBackend(), tmp_path / "missing.json", token_file, 1.0, once=True
        )


async def test_a_rejected_token_is_reported_without_the_token(
    broker: Broker, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker.status = 401
    broker_file = tmp_path / "broker.json"
    point(broker_file, broker.url)
    with pytest.raises(BrokerUnavailableError, match="HTTP 401") as info:
        await run_probe("node-1", FakeBackend(), broker_file, token_file, 1.0, once=True)
    assert TOKEN not in info.value.one_line()
    no_token_in_logs(caplog)


async def test_a_probe_waits_for_the_token_the_broker_makes(
    broker: Broker, token_file: Path, tmp_path: Path
) -> None:
    broker_file = tmp_path / "broker.json"
    point(broker_file, broker.url)
    later = tmp_path / "later.token"
    with pytest.raises(BrokerUnavailableError, match="no node token"):
        await run_probe("n", FakeBackend(), broker_file, later, 1.0, once=True)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(BrokerUnavailableError, match="no node token"):
        await run_probe("n", FakeBackend(), broker_file, empty, 1.0, once=True)
    task = asyncio.create_task(run_probe("n", FakeBackend(), broker_file, later, interval_s=0.1))
    await asyncio.sleep(0.3)
    assert not broker.arrived.is_set()
    later.write_text(token_file.read_text())  # the broker starts and writes its token
    await asyncio.wait_for(broker.arrived.wait(), 10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_sigterm_stops_the_probe_cleanly(
    broker: Broker, token_file: Path, tmp_path: Path
) -> None:
    broker_file = tmp_path / "broker.json"
    point(broker_file, broker.url)
    task = asyncio.create_task(
        run_probe("node-1", FakeBackend(gpus=1), broker_file, token_file, interval_s=30)
    )
    await asyncio.wait_for(broker.arrived.wait(), 10)  # the handlers are installed by now
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 5) == 1  # no wait for the 30 s interval


def test_read_agent_url(tmp_path: Path) -> None:
    path = tmp_path / "broker.json"
    assert read_agent_url(path) is None
    for bad in ("{", "[]", '{"pid": 1}', '{"agent_url": 5}', '{"agent_url": "file:///x"}'):
        path.write_text(bad)
        assert read_agent_url(path) is None, bad
    path.write_text('{"agent_url": "http://10.0.0.1:4000/"}')
    assert read_agent_url(path) == "http://10.0.0.1:4000"
