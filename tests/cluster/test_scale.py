"""`xhpc scale` on the real cluster: up (new ids), the same N (no-op), down (drained first)."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.conftest import Xhpc, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


def _active(x: Xhpc, name: str) -> dict[str, str]:
    return {r["replica_id"]: r["state"] for r in x.json("ps") if r["deployment"] == name}


def test_scale_up_same_and_down_without_failed_requests(xhpc: Xhpc, unique_name: str) -> None:
    x, name = xhpc, unique_name
    x.json(
        "serve",
        "tiny-llama",
        "--name",
        name,
        "--replicas",
        "2",
        "--engine",
        "transformers",
        "--timeout",
        "240",
    )
    up = x.json("scale", name, "3", "--timeout", "240")
    assert up["added"] == [f"{name}-2"] and up["removed"] == []
    assert _active(x, name) == {f"{name}-{i}": "READY" for i in range(3)}
    jobs = sorted(x.my_jobs())
    assert len(jobs) == 3

    same = x.json("scale", name, "3")
    assert (same["added"], same["removed"], same["previous"]) == ([], [], 3)
    assert sorted(x.my_jobs()) == jobs

    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)

    def routed() -> bool:
        try:
            return bool(client.completions.create(model=name, prompt="a", max_tokens=2).choices)
        except openai.InternalServerError:
            return False

    wait_for(routed, 30, "the proxy to route to the deployment")
    errors: list[str] = []
    answered = 0
    done = threading.Event()

    def load() -> None:
        nonlocal answered
        while not done.is_set():
            try:
                client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8
                )
                answered += 1
            except openai.APIError as err:
                errors.append(repr(err))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_for(lambda: answered >= 3, 30, "traffic to flow")
        down = x.json("scale", name, "1", "--timeout", "120")
        after = answered
        wait_for(lambda: answered >= after + 3, 30, "traffic to keep flowing")
    finally:
        done.set()
        worker.join(30)
    # The least loaded replicas went (tested in detail in tests/unit/test_scaling.py); each was
    # drained before its job ended, so no request failed.
    assert errors == []
    assert len(down["removed"]) == 2 and set(down["removed"]) < {f"{name}-{i}" for i in range(3)}
    (kept,) = {f"{name}-{i}" for i in range(3)} - set(down["removed"])
    assert _active(x, name) == {kept: "READY"}
    assert len(x.my_jobs()) == 1
    every = {r["replica_id"]: r for r in x.json("ps", "--all") if r["deployment"] == name}
    for rid in down["removed"]:
        assert every[rid]["state"] == "STOPPED" and every[rid]["reason"] in (
            "job CANCELLED",
            "job ended",
        )
    x.run("stop", name)
