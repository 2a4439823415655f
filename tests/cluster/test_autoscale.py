"""Autoscaling on the dev cluster, with the command engine (an echo server whose streams take
0.2 s a chunk): steady streamed traffic scales a deployment up to its maximum; when the traffic
stops it goes to sleep (no job, still listed); a call then is held by the gateway, wakes it and
is answered once; a caller that allows less than the estimate gets a 503 with Retry-After at
once. Every answer is checked, and each decision is a log line."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_chaos import broker_log, replicas
from tests.cluster.test_pilot import ECHO_ENGINE
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


class Streams:
    """``workers`` callers streaming 20-chunk answers (4 s each) back to back; each answer is
    checked whole: a 200, 20 chunks, then ``[DONE]``."""

    def __init__(self, x: Xhpc, model: str, workers: int) -> None:
        self.x, self.model = x, model
        self.answers: list[tuple[float, str]] = []  # (when it ended, "" or what was wrong)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(workers)]

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.answers.append((time.monotonic(), self._one()))

    def _one(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.x.proxy_port, timeout=60)
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 20, "stream": True}  # fmt: skip
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            raw = resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as err:
            return f"{type(err).__name__}: {err}"
        finally:
            conn.close()
        events = [ln[5:].strip() for ln in raw.splitlines() if ln.startswith("data:")]
        if resp.status != 200 or events[-1:] != ["[DONE]"] or len(events) != 21:
            return f"HTTP {resp.status}, {len(events)} events: {raw[-200:]!r}"
        return ""

    def ok_since(self, t: float) -> int:
        return sum(1 for at, why in self.answers if at >= t and not why)

    def failures(self) -> list[str]:
        return [why for _, why in self.answers if why]


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
        with Streams(x, name, workers=3) as load:
            wait_for(lambda: len([r for r in replicas(x, name) if r["state"] == "READY"]) == 2,
                     120, "a second replica READY")  # fmt: skip
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 3, 60, "traffic on both")
        assert load.failures() == [], load.failures()[:3]
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
        # woken for the calls that found it asleep (this one, and the one refused above)
        assert f"autoscale deployment={name} replicas=0 wanted=" in broker_log(x)
        assert "why=wake" in broker_log(x) and 1 <= len(_live(x, name)) <= 2
        x.run("stop", name)
        x.wait_no_jobs(120)


def test_a_wake_starts_in_the_pilot_the_site_keeps_warm(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    """``[autoscale] pilot_warm_s``: a deployment pinned to a pilot (`--pilot NODE`) goes to
    sleep; its pilot job stays up, so a call wakes it inside that same job (no sbatch, no
    queue); stopped, the pilot has nothing left to wait for and its job is cancelled."""
    name = unique_name
    with own_xhpc(tiny_model, ECHO_ENGINE + "\n[autoscale]\npilot_warm_s = 300\n") as x:
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--pilot", "n3",
              "--pilot-gpus", "1", "--min", "0", "--max", "1", "--idle", "10",
              "--timeout", "120")  # fmt: skip
        (first,) = [r for r in replicas(x, name) if r["state"] == "READY"]
        pilot_job = str(first["job_id"])
        wait_for(lambda: not _live(x, name), 120, "the deployment asleep")
        # The reconcile pass after its replica stopped finds the pilot empty: kept, not cancelled.
        wait_for(lambda: "kept warm 300 s for " + name in broker_log(x), 30, "the pilot kept warm")
        assert x.my_jobs() == [pilot_job]  # the pilot's job still runs, empty
        status, _, answer = _chat(x, name)  # held, wakes it inside the pilot
        assert status == 200 and answer["choices"][0]["message"]["content"] == "gpus=0", answer
        (woken,) = _live(x, name)
        assert woken["replica_id"] != first["replica_id"] and str(woken["job_id"]) == pilot_job
        assert x.my_jobs() == [pilot_job]  # no other job was submitted
        x.run("stop", name)
        x.wait_no_jobs(120)
