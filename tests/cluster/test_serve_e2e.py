"""End to end on the real dev cluster: serve a real tiny model, chat through the proxy, stop."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.conftest import Xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


def _squeue_gpus(job_id: str) -> tuple[str, list[str]]:
    # Slurm 22.05 ignores --jobs with --json: pick the job out of the whole queue.
    out = subprocess.run(
        ["squeue", "--json"], env=slurm_env(), check=True, capture_output=True, text=True
    ).stdout
    (job,) = [j for j in json.loads(out)["jobs"] if str(j["job_id"]) == job_id]
    return job["batch_host"], job["gres_detail"]


def _chat_both_ways(x: Xhpc, model: str) -> None:
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)

    def routed() -> openai.types.chat.ChatCompletion | None:
        # The proxy learns routes by polling the broker: a 503 may precede the first refresh.
        try:
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=6
            )
        except openai.InternalServerError as err:
            assert err.status_code == 503, err
            return None

    reply = wait_for(routed, 30, "the proxy to route to the replicas")
    assert isinstance(reply, openai.types.chat.ChatCompletion)
    assert reply.choices[0].message.content, "no generated text"
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=6,
        stream=True,
    )
    pieces = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) >= 2, f"expected several streamed tokens, got {pieces!r}"
    assert "".join(pieces).strip()
    legacy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    assert legacy.choices[0].text


def _stop_and_check(x: Xhpc, name: str, job_ids: list[str]) -> None:
    stopped = x.json("stop", name)
    assert {r["state"] for r in stopped} == {"STOPPED"}
    wait_for(lambda: not [j for j in x.my_jobs() if j in job_ids], 60, "jobs to leave squeue")
    rows = [r for r in x.json("ps", "--all") if r["deployment"] == name]
    assert rows and {r["state"] for r in rows} == {"STOPPED"}


def _serve(x: Xhpc, name: str, engine: str, *, replicas: int, timeout_s: int) -> Any:
    return x.json(
        "serve",
        "tiny-llama",
        "--name",
        name,
        "--replicas",
        str(replicas),
        "--gpus",
        "1",
        "--engine",
        engine,
        "--timeout",
        str(timeout_s),
    )


def test_two_transformers_replicas_end_to_end(xhpc: Xhpc, unique_name: str) -> None:
    dep = _serve(xhpc, unique_name, "transformers", replicas=2, timeout_s=240)
    replicas = dep["replicas"]
    assert [r["state"] for r in replicas] == ["READY", "READY"]
    # Each replica holds its own GPU, as Slurm itself reports it.
    seen = set()
    for r in replicas:
        host, gres = _squeue_gpus(r["job_id"])
        assert host == r["node"]
        assert len(gres) == 1 and gres[0].startswith("gpu:1(IDX:")
        idx = int(gres[0].split("IDX:")[1].rstrip(")"))
        assert r["gpus"] == [idx]
        seen.add((host, idx))
    assert len(seen) == 2, f"replicas share a GPU: {seen}"
    _chat_both_ways(xhpc, unique_name)
    # Stopping one replica by its id leaves the other serving.
    first, second = replicas
    (stopped,) = xhpc.json("stop", first["replica_id"])
    assert stopped["state"] == "STOPPED"
    states = {r["replica_id"]: r["state"] for r in xhpc.json("ps", "--all")}
    assert states[first["replica_id"]] == "STOPPED" and states[second["replica_id"]] == "READY"
    _stop_and_check(xhpc, unique_name, [r["job_id"] for r in replicas])


def test_vllm_cpu_end_to_end(xhpc: Xhpc, unique_name: str) -> None:
    dep = _serve(xhpc, unique_name, "vllm", replicas=1, timeout_s=400)
    (replica,) = dep["replicas"]
    assert replica["state"] == "READY"
    _chat_both_ways(xhpc, unique_name)
    # The engine's context length, as vLLM states it (the site's --max-model-len 512), under
    # the public name; and a body no prompt in that context could need never reaches it.
    with urllib.request.urlopen(f"{xhpc.proxy_url}/v1/models/{unique_name}", timeout=30) as r:
        card = json.loads(r.read())
    assert (card["id"], card["root"], card["max_model_len"]) == (unique_name, unique_name, 512)
    huge = {"model": unique_name, "messages": [{"role": "user", "content": "x" * 200_000}]}
    req = urllib.request.Request(
        f"{xhpc.proxy_url}/v1/chat/completions",
        data=json.dumps(huge).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["code"] == "context_length_exceeded"
    # The engine's own metrics, federated: on the gateway's /metrics (no key on the dev
    # cluster), labelled with its deployment, replica, job and node; the broker's beside them.
    labels = (f'deployment="{unique_name}"', f'replica="{replica["replica_id"]}"',
              f'job="{replica["job_id"]}"', f'node="{replica["node"]}"')  # fmt: skip

    def federated() -> str:
        with urllib.request.urlopen(f"{xhpc.proxy_url}/metrics", timeout=30) as r:
            text = r.read().decode()
        engine = [
            ln
            for ln in text.splitlines()
            if ln.startswith("vllm:num_requests_running{") and all(x in ln for x in labels)
        ]
        return text if engine else ""  # fmt: skip

    text = str(wait_for(federated, 60, "the engine's series on the gateway's /metrics"))
    lines = text.splitlines()
    assert [ln for ln in lines if ln.startswith("xhpc_broker_up") and ln.endswith(" 1")], text
    ready = [ln for ln in lines if ln.startswith("xhpc_broker_replicas{") and ln.endswith(" 1")
             and labels[0] in ln and 'state="READY"' in ln]  # fmt: skip
    assert len(ready) == 1, [ln for ln in lines if ln.startswith("xhpc_broker_replicas")]
    assert "# TYPE vllm:num_requests_running gauge" in text
    _stop_and_check(xhpc, unique_name, [replica["job_id"]])
