"""`xhpc logs`: the broker reads only the end of a replica's logs, however large they grew,
and off its event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.test_broker_service import make
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.broker.watch import replica_logs
from xhpc.broker.watch.replica_logs import LOG_TAIL_BYTES
from xhpc.models import LogsView, NodeInfo, ServeRequest

HUGE = 64 * LOG_TAIL_BYTES  # sparse: costs no disk, but reading it whole would cost 64 MiB


def _huge_log(path: Path, tail: str) -> None:
    """A ``HUGE`` log: holes, then one long line cut by the bound, then ``tail``."""
    with path.open("wb") as fh:
        fh.truncate(HUGE - LOG_TAIL_BYTES)
        fh.seek(0, os.SEEK_END)
        fh.write(b"x" * LOG_TAIL_BYTES + b"\n")  # one line longer than the bound
        fh.write(tail.encode())


async def _served(tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path) -> BrokerService:
    service, _ = make(tmp_path, idle_nodes)
    await service.serve(ServeRequest(model=str(model_dir)))
    row = service.store.replica("m-0")
    job = service.store.job("m-0", str(row.job_id))
    assert job is not None and job.output_path is not None and row.replica_dir
    tail = "".join(f"line {i}\n" for i in range(500))
    _huge_log(Path(job.output_path.replace("%j", str(row.job_id))), tail)
    _huge_log(Path(row.replica_dir) / f"engine-{row.job_id}.log", tail)
    return service


async def test_a_huge_log_is_read_from_its_end_only(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = await _served(tmp_path, idle_nodes, model_dir)
    view = service.logs("m-0", lines=3)
    assert view.job_output == view.engine_log == "line 497\nline 498\nline 499"
    every = service.logs("m-0", lines=10**9)  # more lines than the bound holds
    for text in (every.job_output, every.engine_log):
        assert len(text.encode()) <= LOG_TAIL_BYTES
        assert text.endswith("line 499") and "line 0\n" in text
        assert not text.startswith("x")  # the line cut by the bound is left out
    assert service.logs("m-0", lines=0).job_output == ""


async def test_the_logs_endpoint_reads_off_the_event_loop_and_bounded(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = await _served(tmp_path, idle_nodes, model_dir)
    loop_thread = threading.get_ident()
    readers: list[int] = []
    real_tail = replica_logs.tail

    def tail(path: Path, lines: int) -> str:
        readers.append(threading.get_ident())
        return real_tail(path, lines)

    monkeypatch.setattr(replica_logs, "tail", tail)
    async with TestClient(TestServer(control_app(service))) as client:
        resp = await client.get("/v1/replicas/m-0/logs?lines=100000")
        assert resp.status == 200
        body = await resp.read()
        bad = await client.get("/v1/replicas/m-0/logs?lines=lots")
        assert bad.status == 400
    view = LogsView.model_validate_json(body)
    assert len(view.job_output.encode()) <= LOG_TAIL_BYTES
    assert len(view.engine_log.encode()) <= LOG_TAIL_BYTES
    assert len(body) <= 2 * LOG_TAIL_BYTES + 1024
    assert view.engine_log.endswith("line 499")
    assert readers and loop_thread not in readers


async def test_a_fifo_in_place_of_a_log_does_not_hang_the_broker(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service = await _served(tmp_path, idle_nodes, model_dir)
    row = service.store.replica("m-0")
    engine_log = Path(str(row.replica_dir)) / f"engine-{row.job_id}.log"
    engine_log.unlink()
    os.mkfifo(engine_log)
    view = await asyncio.wait_for(service.tail_logs("m-0"), 10)
    assert view.engine_log == ""
    assert view.job_output.endswith("line 499")
