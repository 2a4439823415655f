"""A replica's engine dies mid-load on the real cluster: requests sent after it died go to the
other replica (no client error), requests the engine had when it died are answered 502 and never
sent elsewhere (the request may be what killed it: decision 0015), a stream already running ends
with an error event instead of hanging, and the dead replica leaves the routing table."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def xhpc_echo2(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE)
    yield x
    _teardown_xhpc(x)


def _engine_pid(port: int) -> int:
    """The echo engine listening on ``port`` (in a node's namespace; this test started it)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(c.endswith("echo_engine.py") for c in cmd) and str(port) in cmd:
            return int(proc.name)
    raise AssertionError(f"no echo engine on port {port}")


def test_a_dying_replica_costs_no_request(xhpc_echo2: Xhpc, unique_name: str) -> None:
    x, name = xhpc_echo2, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--replicas", "2",
          "--timeout", "90")  # fmt: skip
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

    def ask() -> str:
        reply = client.chat.completions.create(model=name, messages=msgs, max_tokens=1)
        return reply.id

    seen: set[str] = set()

    def both_routed() -> bool:
        try:
            seen.add(ask())
        except openai.APIError:
            return False
        return len(seen) == 2

    wait_for(both_routed, 30, "both replicas to answer through the proxy")
    errors: list[tuple[float, int | None, str]] = []  # sent at, status, what
    answered = 0
    done = threading.Event()

    def load() -> None:
        nonlocal answered
        while not done.is_set():
            sent = time.monotonic()
            try:
                ask()
                answered += 1
            except openai.APIError as err:
                errors.append((sent, getattr(err, "status_code", None), repr(err)[:200]))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        # A long stream; its first chunk names the replica (by port) that serves it.
        stream = client.chat.completions.create(
            model=name,
            messages=msgs,
            max_tokens=200,
            stream=True,
        )
        it = iter(stream)
        victim_port = int(next(it).id.rsplit("-", 1)[1])
        killed_at = time.monotonic()
        os.kill(_engine_pid(victim_port), signal.SIGKILL)
        ended = threading.Event()
        outcome: list[str] = []

        def drain() -> None:
            try:
                for _ in it:
                    pass
                outcome.append("ended")
            except openai.APIError as err:  # the proxy's error event
                outcome.append(f"error event: {err}")
            except Exception as err:
                outcome.append(f"broken: {err!r}")
            ended.set()

        threading.Thread(target=drain, daemon=True).start()
        assert ended.wait(30), "the stream hung after its replica died"
        assert outcome and not outcome[0].startswith("broken"), outcome
        before = answered
        wait_for(lambda: answered >= before + 20, 60, "more requests answered after the crash")
    finally:
        done.set()
        for t in threads:
            t.join(30)
    # Only requests already on the dead engine failed (at most one per load thread), as 502s.
    assert len(errors) <= len(threads), errors
    assert all(status == 502 and sent < killed_at + 1 for sent, status, _ in errors), errors

    def ready() -> int:
        rows: list[dict[str, Any]] = json.loads(x.run("ps", "--json").stdout)
        return [r["state"] for r in rows if r["deployment"] == name].count("READY")

    wait_for(lambda: ready() == 1, 60, "the dead replica to leave READY")
    x.run("stop", name)
