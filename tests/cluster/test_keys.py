"""API keys on the real cluster, through the official openai SDK: a wrong key is 401, over
the rate is 429, another user's model is 404 (and not listed), usage lands in `xhpc usage`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def xhpc_keys(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE + '\n[proxy]\nauth = "keys"\nmax_body_bytes = 4096\n')
    yield x
    _teardown_xhpc(x)


def _key(x: Xhpc, *args: str) -> str:
    made: dict[str, Any] = json.loads(x.run("keys", "create", *args, "--json").stdout)
    return str(made["key"])


def test_keys_gate_the_gateway(xhpc_keys: Xhpc, unique_name: str) -> None:
    x, name = xhpc_keys, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90")
    mine = _key(x, "--user", "root", "--rpm", "3")
    other = _key(x, "--user", "xhpc-member", "--account", "lab2")  # its Slurm association
    spare = _key(x, "--user", "root")  # no rate limit: for the malformed bodies below
    # The key is shown once: the broker keeps only its digest.
    listed = x.run("keys", "list", "--json").stdout
    assert mine.split(".")[1] not in listed and mine.split(".")[0][5:] in listed

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key=key, max_retries=0)

    def ask(key: str) -> str:
        reply = client(key).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        return reply.choices[0].message.content or ""

    def routed() -> bool:
        # Every key made above has reached every proxy worker (grants sync once a second; each
        # new client connection may land on either worker: ask several times in a row).
        try:
            return all(
                [m.id for m in client(k).models.list()] == [name]
                for _ in range(8)
                for k in (mine, spare)
            )
        except openai.APIError:
            return False

    wait_for(routed, 30, "the proxy to route the model for its owner's key")
    with pytest.raises(openai.AuthenticationError):
        ask(mine + "x")
    with pytest.raises(openai.AuthenticationError):
        ask("sk-not-an-xhpc-key")
    # Another user's key: the model does not exist for it.
    assert [m.id for m in client(other).models.list()] == []
    with pytest.raises(openai.NotFoundError):
        ask(other)
    # The owner's key works until its rate (3 a minute) is spent.
    assert ask(mine).startswith("gpus=")
    assert ask(mine).startswith("gpus=")
    with pytest.raises(openai.RateLimitError) as limited:
        for _ in range(3):
            ask(mine)
    assert int(limited.value.response.headers["Retry-After"]) >= 1

    def counted() -> bool:
        lines = json.loads(x.run("usage", "--json").stdout)
        return any(u["user"] == "root" and u["model"] == name and u["requests"] >= 3 for u in lines)

    wait_for(counted, 30, "the proxy's batched usage to reach `xhpc usage`")
    # Malformed and oversized bodies: OpenAI-shaped 400 and 413.
    for body, status in (
        (b"{not json", 400),
        (json.dumps({"model": name, "messages": [], "pad": "x" * 5000}).encode(), 413),
    ):
        raw = urllib.request.Request(
            f"{x.proxy_url}/v1/chat/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {spare}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(raw, timeout=10)
        assert refused.value.code == status
        error = json.loads(refused.value.read())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    x.run("stop", name)
