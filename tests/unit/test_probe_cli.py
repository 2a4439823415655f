"""`xhpc probe` through click's runner with an injected context (not registered in main.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from click.testing import CliRunner, Result

from xhpc.cli.context import Ctx
from xhpc.cli.daemons import probe
from xhpc.config import load_config
from xhpc.models import ProbeReport
from xhpc.nvml import NvmlUnavailable
from xhpc.probe.runner import PROBE_PATH


@pytest.fixture
def ctx(clean_env: Path) -> Ctx:
    config, sources = load_config()
    return Ctx(config=config, sources=sources)


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)


def invoke(ctx: Ctx, *args: str) -> Result:
    return CliRunner().invoke(probe, list(args), obj=ctx)


def test_once_json_with_two_fake_gpus(ctx: Ctx) -> None:
    result = invoke(ctx, "--once", "--json", "--backend", "fake", "--fake-gpus", "2")
    assert result.exit_code == 0, result.output
    report = ProbeReport.model_validate_json(result.stdout)
    assert report.backend == "fake" and [g.index for g in report.gpus] == [0, 1]
    assert report.node == socket.gethostname()
    assert report.mem_total_mb is not None and report.errors == ()


def test_once_table_shows_health_and_foreign_processes(ctx: Ctx, tmp_path: Path) -> None:
    fake = tmp_path / "node.toml"
    fake.write_text(
        "count = 3\n"
        "[[gpus]]\nindex = 1\nlost = true\n"
        "[[gpus]]\nindex = 2\nname = '[bold]x'\n"
        "processes = [{ pid = 999, mem_used_mb = 2048 }, { pid = 5, job_id = '17' }]\n"
    )
    result = invoke(ctx, "--once", "--backend", "fake", "--fake-file", str(fake), "--node", "n3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "node n3" in out and "backend fake" in out
    assert "UNHEALTHY" in out and "GPU is lost" in out
    assert "999 (foreign, 2048 MiB)" in out and "5 (job 17, - MiB)" in out
    assert "[bold]x" in out  # names are shown, not interpreted as markup


def test_auto_without_nvml_uses_the_fake_backend(ctx: Ctx, no_nvml: None) -> None:
    result = invoke(ctx, "--once", "--json", "--fake-gpus", "1", "--node", "n1")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the fallback warning does not go to stdout
    assert report["backend"] == "fake" and len(report["gpus"]) == 1


def test_nvml_backend_without_nvml_is_a_typed_error(ctx: Ctx, no_nvml: None) -> None:
    result = invoke(ctx, "--once", "--backend", "nvml")
    assert isinstance(result.exception, NvmlUnavailable)


def test_bad_flags(ctx: Ctx) -> None:
    assert invoke(ctx, "--json", "--backend", "fake").exit_code == 2  # --json needs --once
    assert invoke(ctx, "--once", "--node", "a b;c").exit_code == 2
    assert invoke(ctx, "--once", "--interval", "0").exit_code == 2


class ThreadedBroker:
    """A probe endpoint in its own thread and loop, for a command that runs asyncio.run itself."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, ProbeReport]] = []
        self.arrived = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _probe(self, request: web.Request) -> web.Response:
        report = ProbeReport.model_validate_json(await request.text())
        self.reports.append((request.headers.get("Authorization", ""), report))
        self.arrived.set()
        return web.json_response({"status": "ok"})

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post(PROBE_PATH, self._probe)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> ThreadedBroker:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def threaded_broker() -> Iterator[ThreadedBroker]:
    with ThreadedBroker() as b:
        yield b


def test_daemon_reports_to_the_broker_until_sigterm(
    ctx: Ctx, threaded_broker: ThreadedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # the command raises it to INFO; undo after
    broker_file = tmp_path / "broker.json"
    broker_file.write_text(json.dumps({"agent_url": f"http://127.0.0.1:{threaded_broker.port}"}))
    token = tmp_path / "token"
    token.write_text("tok-123")

    def stop_after_two_reports() -> None:
        for _ in range(2):
            threaded_broker.arrived.wait(20)
            threaded_broker.arrived.clear()
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=stop_after_two_reports, daemon=True)
    killer.start()
    result = invoke(
        ctx,
        "--backend",
        "fake",
        "--fake-gpus",
        "4",
        "--node",
        "n2",
        "--interval",
        "0.05",
        "--broker-file",
        str(broker_file),
        "--token-file",
        str(token),
    )
    killer.join(5)
    assert result.exit_code == 0, result.output
    assert len(threaded_broker.reports) >= 2
    auth, report = threaded_broker.reports[0]
    assert auth == "Bearer tok-123"
    assert report.node == "n2" and len(report.gpus) == 4
    assert "tok-123" not in result.output
