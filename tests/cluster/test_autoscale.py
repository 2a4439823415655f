"""Autoscaling on the dev cluster, with the command engine (an echo server whose streams take
0.2 s a chunk): steady streamed traffic scales a deployment up to its maximum; when the traffic
stops it goes to sleep (no job, still listed); a call then is held by the gateway, wakes it and
is answered once; a caller that allows less than the estimate gets a 503 with Retry-After at
once. Every answer is checked, and each decision is a log line."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_chaos import broker_log, replicas
from tests.cluster.test_pilot import ECHO_ENGINE
from tests.cluster.traffic import Traffic
from tests.conftest import Xhpc, own_xhpc, wait_for

pytestmark = pytest.mark.cluster


def _chat(x: Xhpc, model: str, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", x.proxy_port, timeout=120)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _models(x: Xhpc) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", x.proxy_port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        return [m["id"] for m in json.loads(conn.getresponse().read())["data"]]
    finally:
        conn.close()


def _live(x: Xhpc, name: str) -> list[dict[str, Any]]:
    return [r for r in replicas(x, name) if r["state"] not in ("STOPPED", "FAILED")]


def test_demand_scales_up_idle_sleeps_and_a_held_call_wakes_it(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    name = unique_name
    with own_xhpc(tiny_model, ECHO_ENGINE) as x:
        policy = ("--min", "0", "--max", "2", "--target-inflight", "1", "--idle", "10")
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", *policy,
              "--timeout", "120")  # fmt: skip
        assert f"{name}: autoscaled 0..2" in x.run("ps").stdout

        # Three streams at a time, 4 s each: 3 in flight at 1 per replica: up to the maximum.
        body: dict[str, object] = {"max_tokens": 20}
        with Traffic(x.proxy_url, name, workers=3, extra=body) as load:
            wait_for(lambda: len([r for r in replicas(x, name) if r["state"] == "READY"]) == 2,
                     120, "a second replica READY")  # fmt: skip
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 3, 60, "traffic on both")
        assert load.failures() == [] and load.truncated() == [], load.summary()
        assert f"autoscale deployment={name} replicas=1 wanted=2 why=demand" in broker_log(x)

        # Idle for 10 s: asleep (no job left), and still listed.
        wait_for(lambda: not _live(x, name), 120, "the deployment asleep")
        assert "wanted=0 why=idle" in broker_log(x)
        assert name in _models(x)
        assert "asleep (a request wakes it)" in x.run("ps").stdout

        # A caller that waits less than a start takes: 503 at once, with the estimate.
        t0 = time.monotonic()
        status, headers, answer = _chat(x, name, {"X-Xhpc-Max-Wait": "0"})
        assert status == 503 and answer["error"]["code"] == "model_waking", answer
        assert int(headers["Retry-After"]) >= 1 and time.monotonic() - t0 < 5

        # A call: held, wakes it, answered once by the new replica.
        status, _, answer = _chat(x, name)
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"].startswith("gpus=")
        assert "wanted=1 why=wake" in broker_log(x)
        assert len(_live(x, name)) == 1
        x.run("stop", name)
        x.wait_no_jobs(120)
