"""`xhpc top --once` on the real cluster: a model served with the cheap `command` engine shows
as a READY replica row with its job and node, its GPU in the node rows held by it, its traffic
through the proxy (from the proxy's /metrics) and its events."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc

pytestmark = pytest.mark.cluster


@pytest.fixture
def xhpc_echo(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE)
    yield x
    _teardown_xhpc(x)


def _chat(x: Xhpc, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        f"{x.proxy_url}/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200


def test_top_once_shows_the_replica_its_gpu_traffic_and_events(
    xhpc_echo: Xhpc, unique_name: str
) -> None:
    x, name = xhpc_echo, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90")
    for _ in range(3):
        _chat(x, name)
    (replica,) = [r for r in json.loads(x.run("ps", "--json").stdout) if r["deployment"] == name]
    node, job = replica["node"], replica["job_id"]
    assert node and job

    done = x.run("top", "--once", "--interval", "0.5", timeout=60)
    lines = done.stdout.splitlines()
    assert done.stderr == ""
    # The replica's row: state, its job and node (the job id as a column of its own: the random
    # name may hold its digits, and the events also name the replica with READY).
    row = [ln for ln in lines if f"{name}-0" in ln.split() and "READY" in ln.split()
           and job in ln.split()]  # fmt: skip
    assert len(row) == 1 and node in row[0], done.stdout
    # The node rows: every node of the dev cluster, the replica's GPU held by it.
    for n in ("n1", "n2", "n3"):
        assert any(ln.startswith(f"{n} ") for ln in lines), done.stdout
    nodes_part = lines[: next(i for i, ln in enumerate(lines) if ln.strip() == "deployments")]
    assert any(f"{name}-0" in ln for ln in nodes_part), done.stdout
    # Its traffic through the proxy (dev cluster: /metrics needs no key), and its events.
    traffic = [ln for ln in lines if ln.startswith(f"{name} ") and "READY" not in ln]
    assert len(traffic) == 1 and int(traffic[0].split()[2]) >= 3, done.stdout
    assert "READY:" in done.stdout

    data: dict[str, Any] = json.loads(x.run("top", "--json", "--interval", "0.5").stdout)
    (dep,) = [d for d in data["overview"]["deployments"] if d["name"] == name]
    assert [r["state"] for r in dep["replicas"]] == ["READY"]
    assert node in [n["name"] for n in data["overview"]["nodes"]["nodes"]]
    assert data["traffic_note"] is None
    x.run("stop", name)
