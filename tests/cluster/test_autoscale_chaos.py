"""Autoscaling under faults, on the dev cluster with the command engine (the echo server): a
wake whose job fails answers the held calls with a clear error before their wait runs out, and
the next wake serves; the broker killed while calls are held for a sleeping model: started
again, it wakes the model and the held calls are answered, each once and whole; the node of
the replica a scale-down keeps fails: the calls that reach no engine are held until the
replacement serves, and none is lost."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_autoscale import Streams
from tests.cluster.test_chaos import broker_log, node_state, replicas
from tests.cluster.test_pilot import ECHO
from tests.conftest import DEV_CLUSTER, Xhpc, own_xhpc, wait_for

pytestmark = pytest.mark.cluster

SLEEPY = ("--min", "0", "--max", "1", "--idle", "10")


def _engine(marker: Path) -> str:
    """The echo engine, which exits at start while ``marker`` exists; a failed start is
    replaced after 8 s (held calls are told at once, not after the replacement)."""
    return f"""
[engines.command]
command = ["{sys.executable}", "{ECHO}", "--port", "{{port}}",
           "--served-model", "{{served_model}}", "--crash-if", "{marker}"]
startup_timeout_s = 60

[lifecycle]
backoff_s = 8
crash_loop_starts = 5
"""


class Held(threading.Thread):
    """One call for a sleeping model, streamed or not, in the background: its status, its
    SSE comments and data events (streamed), or its JSON body."""

    def __init__(self, x: Xhpc, model: str, stream: bool, max_wait: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.x, self.model, self.stream, self.max_wait = x, model, stream, max_wait
        self.status = 0
        self.comments: list[str] = []
        self.events: list[str] = []
        self.body: Any = None
        self.took = float("nan")
        self.error = ""

    def run(self) -> None:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.x.proxy_port, timeout=180)
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "stream": self.stream}  # fmt: skip
        headers = {"Content-Type": "application/json", "X-Xhpc-Max-Wait": f"{self.max_wait:g}"}
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            self.status = resp.status
            if not self.stream or resp.status != 200:
                self.body = json.loads(resp.read() or b"null")
                return
            while line := resp.readline():
                text = line.decode().rstrip("\r\n")
                if text.startswith(":"):
                    self.comments.append(text)
                elif text.startswith("data:"):
                    self.events.append(text[5:].strip())
        except (OSError, http.client.HTTPException, ValueError) as err:
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.took = time.monotonic() - t0
            conn.close()

    def whole(self) -> bool:
        """Answered once and whole: a 200 with its 3 chunks then [DONE], or the JSON answer."""
        if self.stream:
            data = [json.loads(e) for e in self.events if e != "[DONE]"]
            return (self.status == 200 and self.events[-1:] == ["[DONE]"] and len(data) == 3
                    and all("error" not in d for d in data))  # fmt: skip
        return self.status == 200 and self.body["choices"][0]["message"]["content"].startswith(
            "gpus="
        )


def _asleep(x: Xhpc, name: str) -> None:
    wait_for(lambda: not [r for r in replicas(x, name) if r["state"] not in ("STOPPED", "FAILED")],
             120, "the deployment asleep")  # fmt: skip
    assert "asleep (a request wakes it)" in x.run("ps").stdout


def test_a_wake_whose_job_fails_tells_the_held_calls_then_the_next_wake_serves(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    name, marker = unique_name, tmp_path / "crash-now"
    with own_xhpc(tiny_model, _engine(marker)) as x:
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", *SLEEPY,
              "--timeout", "120")  # fmt: skip
        _asleep(x, name)
        marker.write_text("")  # the wake's engine exits at start: its replica FAILS
        calls = [Held(x, name, stream=True), Held(x, name, stream=False)]
        for c in calls:
            c.start()
        for c in calls:
            c.join(150)
        streamed, plain = calls
        assert not streamed.error and not plain.error, (streamed.error, plain.error)
        # Told before their 120 s ran out, with the reason: an error event ending the stream
        # (its 200 began with the first comment), a 503 for the plain call.
        assert streamed.took < 100 and plain.took < 100, (streamed.took, plain.took)
        assert streamed.status == 200 and streamed.comments, streamed.comments
        last = json.loads(streamed.events[-1])
        assert last["error"]["code"] == "wake_failed", last
        assert "[DONE]" not in streamed.events
        assert plain.status == 503 and plain.body["error"]["code"] == "wake_failed", plain.body
        assert "failed" in plain.body["error"]["message"]
        assert "why=wake" in broker_log(x)

        # The engine starts again: the keeper's next start serves. Meanwhile a call is told
        # at once why it cannot be served (the last wake failed), never left hanging.
        marker.unlink()
        refused: list[Any] = []

        def answered() -> bool:
            again = Held(x, name, stream=False, max_wait=150)
            again.run()
            if not again.whole():
                assert again.status == 503, (again.status, again.body, again.error)
                assert again.body["error"]["code"] in ("wake_failed", "model_waking"), again.body
                refused.append(again.body)
            return again.whole()

        wait_for(answered, 120, "a call answered after the engine starts again", 2.0)
        x.run("stop", name)
        x.wait_no_jobs(120)


def test_calls_held_while_the_broker_is_down_are_answered_once_it_is_back(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    name = unique_name
    with own_xhpc(tiny_model, _engine(tmp_path / "never")) as x:
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", *SLEEPY,
              "--timeout", "120")  # fmt: skip
        _asleep(x, name)
        broker = x.procs[0]
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        x.procs.remove(broker)
        # The gateway holds them from its last table (asleep, wakeable); no broker hears them.
        calls = [Held(x, name, stream=True), Held(x, name, stream=False)]
        for c in calls:
            c.start()
        wait_for(lambda: calls[0].comments, 30, "the stream held (its first comment)")
        assert "waiting for a replica of" in calls[0].comments[0]
        assert all(c.is_alive() for c in calls)  # held, not refused
        x.start("broker")  # the held calls, reported at the next sync, wake it
        for c in calls:
            c.join(150)
        streamed, plain = calls
        assert streamed.whole(), (streamed.status, streamed.events, streamed.error)
        assert plain.whole(), (plain.status, plain.body, plain.error)
        # one wake: one replica, READY, serving both
        live = [r for r in replicas(x, name) if r["state"] not in ("STOPPED", "FAILED")]
        assert len(live) == 1 and live[0]["state"] == "READY", live
        assert "why=wake" in broker_log(x)
        x.run("stop", name)
        x.wait_no_jobs(120)


class Calls(threading.Thread):
    """Plain calls back to back, each checked whole (``Held.whole``), until stopped."""

    def __init__(self, x: Xhpc, model: str) -> None:
        super().__init__(daemon=True)
        self.x, self.model = x, model
        self.answers: list[tuple[float, float, str]] = []  # (began, took, "" or what was wrong)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            call = Held(self.x, self.model, stream=False, max_wait=120)
            began = time.monotonic()
            call.run()
            wrong = "" if call.whole() else f"{call.status} {call.body} {call.error}"
            self.answers.append((began, call.took, wrong))
            time.sleep(0.1)

    def failures(self) -> list[str]:
        return [why for _, _, why in self.answers if why]


def test_the_node_of_the_replica_a_scale_down_keeps_fails_and_no_call_is_lost(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    """Two replicas; the traffic drops to one caller and the policy takes one away (drained,
    or draining); then the node of the one it keeps fails. Calls routed there reach no engine
    (or find its whole job gone): each is held until the broker's replacement (the replica
    re-planned as a new job) serves, then answered. Stopped then, nothing starts it again."""
    name = unique_name
    config = _engine(tmp_path / "never") + "lost_grace_s = 20\n"
    with own_xhpc(tiny_model, config) as x:
        policy = ("--min", "1", "--max", "2", "--target-inflight", "2", "--down-window", "10")
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", *policy,
              "--timeout", "120")  # fmt: skip
        with Streams(x, name, workers=3) as load:
            wait_for(lambda: len([r for r in replicas(x, name) if r["state"] == "READY"]) == 2,
                     120, "a second replica READY")  # fmt: skip
        assert load.failures() == [], load.failures()[:3]
        calls = Calls(x, name)
        calls.start()
        node = ""
        try:
            # One caller: the policy scales down to one replica (the other drained away).
            def scaled_down() -> bool:
                rows = replicas(x, name, all_=True)
                left = [r for r in rows if r["state"] in ("DRAINING", "STOPPED")]
                kept = [r for r in rows if r["state"] == "READY"]
                return bool(left) and len(kept) == 1

            wait_for(scaled_down, 120, "a scale-down to one replica", 0.2)
            (kept,) = [r for r in replicas(x, name) if r["state"] == "READY"]
            node = str(kept["node"])
            failed_at = time.monotonic()
            subprocess.run([str(DEV_CLUSTER), "node-fail", node.removeprefix("n")], check=True)

            def replaced() -> bool:  # re-planned (the same replica, a new job) or replaced
                rows = [r for r in replicas(x, name) if r["state"] == "READY"]
                return any(r["node"] != node for r in rows)

            wait_for(replaced, 120, "a replacement READY on another node")
            wait_for(lambda: sum(1 for b, _, w in calls.answers if b > failed_at and not w) >= 5,
                     60, "calls answered after the loss")  # fmt: skip
        finally:
            calls.stop.set()
            calls.join(150)
            if node:
                subprocess.run([str(DEV_CLUSTER), "node-up", node.removeprefix("n")], check=True)
        assert calls.failures() == [], calls.failures()[:3]
        # Some calls were held through the loss (they waited for the replacement), none lost.
        held = [took for began, took, _ in calls.answers if began >= failed_at - 1 and took > 1]
        assert held, [a for a in calls.answers if a[0] >= failed_at - 1][:5]
        assert f"autoscale deployment={name} replicas=2 wanted=1 why=low" in broker_log(x)
        x.run("stop", name)
        x.wait_no_jobs(180)
        wait_for(lambda: node_state(node) in ("idle", "mixed"), 120, f"{node} back in service")
