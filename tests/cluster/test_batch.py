"""Batches on the real dev cluster with a real engine (transformers, the tiny model): a Slurm job
array whose shard is killed with SIGKILL halfway and requeued by the broker, every line answered
exactly once and as a request sent on its own answers it (greedy); a malformed line gets its own
error line; a cancelled batch keeps what it answered and leaves no task behind."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

import xhpc
from tests.conftest import Xhpc, own_xhpc, slurm_env, wait_for
from xhpc.config import load_config

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

CHAT = "/v1/chat/completions"
MALFORMED_AT = 3


def _input(path: Path, count: int, tag: str) -> list[dict[str, Any]]:
    """``count`` greedy chat requests and one malformed line (at MALFORMED_AT)."""
    requests = []
    for i in range(count):
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": f"{tag} question {i}: say {i * 7}"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        requests.append({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": body})
    lines = [json.dumps(r) for r in requests]
    # JSON, but no request (a line that is not JSON is refused with the whole input).
    lines.insert(MALFORMED_AT, json.dumps({"custom_id": "broken", "url": CHAT}))
    path.write_text("\n".join(lines) + "\n")
    return requests


def _status(x: Xhpc, batch_id: str) -> dict[str, Any]:
    view: dict[str, Any] = json.loads(x.run("batch", "status", batch_id, "--json").stdout)
    return view


def _records(path: Path) -> int:
    try:
        return sum(1 for ln in path.read_text().splitlines() if ln.endswith("}"))
    except FileNotFoundError:
        return 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _tasks(job: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%i %T"], env=slurm_env(), capture_output=True,
        text=True, check=False,
    ).stdout  # fmt: skip
    return [ln for ln in out.splitlines() if ln.strip()]


def test_a_batch_survives_a_killed_shard_and_a_cancelled_one_keeps_its_answers(
    dev_cluster: Path, tiny_model: Path, tmp_path: Path
) -> None:
    with own_xhpc(tiny_model) as x:
        _killed_shard_then_cancel(x, tmp_path)


def _killed_shard_then_cancel(x: Xhpc, tmp_path: Path) -> None:
    requests = _input(tmp_path / "in.jsonl", 24, "k")
    wait_for(lambda: _answers(f"{x.proxy_url}/health"), 30, "the proxy to listen")
    # Through the proxy with the openai SDK: the file, then the batch (how it runs: metadata).
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{x.proxy_port}/v1", api_key="none",
                        max_retries=0)  # fmt: skip
    uploaded = sdk.files.create(file=(tmp_path / "in.jsonl").open("rb"), purpose="batch")
    created = sdk.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
        metadata={"xhpc_engine": "transformers", "xhpc_shards": "2", "xhpc_gpus": "1",
                  "xhpc_concurrency": "1"},
    )  # fmt: skip
    view = _status(x, created.id)
    batch_id, job = view["id"], view["job_id"]
    assert view["status"] == "in_progress" and view["request_counts"]["total"] == 25
    shard0 = x.state_dir / "batches" / batch_id / "shards" / "0.jsonl"

    # Shard 0 answers its lines one at a time; kill its task once it has answered a few.
    wait_for(lambda: _records(shard0) >= 3, 300, "shard 0 to answer three lines")
    subprocess.run(["scancel", "--signal=KILL", f"{job}_0"], env=slurm_env(), check=True)
    killed_at = _records(shard0)
    assert killed_at < 13, "shard 0 finished before the kill: the test needs slower requests"

    ended = wait_for(
        lambda: (v := _status(x, batch_id))["status"] not in ("in_progress", "finalizing") and v,
        420, "the batch to end",
    )  # fmt: skip
    assert isinstance(ended, dict)
    assert ended["status"] == "completed", ended
    assert ended["requeues"] == {"0": 1}, json.dumps(ended)  # requeued once, by the broker
    assert ended["request_counts"] == {"total": 25, "completed": 24, "failed": 1}

    outs = [json.loads(ln) for ln in x.run("batch", "results", batch_id).stdout.splitlines()]
    errs = [
        json.loads(ln) for ln in x.run("batch", "results", batch_id, "--errors").stdout.splitlines()
    ]
    assert [o["custom_id"] for o in outs] == [r["custom_id"] for r in requests]  # once, in order
    assert len(errs) == 1 and errs[0]["custom_id"] == "broken"
    assert f"line {MALFORMED_AT + 1}: body must be a JSON object" in errs[0]["error"]["message"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outs)

    # The same requests, one by one, to the same model served on its own: the same answers.
    cfg = load_config(env=x.env)[0]
    with xhpc.local("tiny-llama", gpus=0, engine="transformers", config=cfg) as one:
        client = one.openai(max_retries=0)
        for req, out in zip(requests, outs, strict=True):
            body = {k: v for k, v in req["body"].items() if k != "model"}
            alone = client.chat.completions.create(model=one.model, **body)
            got = out["response"]["body"]["choices"][0]["message"]["content"]
            assert got == alone.choices[0].message.content, req["custom_id"]

    # A second batch, cancelled once it has answered a few lines.
    _input(tmp_path / "more.jsonl", 40, "c")
    second = json.loads(
        x.run(
            "batch", "submit", str(tmp_path / "more.jsonl"), "--model", "tiny-llama",
            "--engine", "transformers", "--concurrency", "1", "--json",
        ).stdout
    )  # fmt: skip
    progress = x.state_dir / "batches" / second["id"] / "shards" / "0.jsonl"
    wait_for(lambda: _records(progress) >= 2, 300, "the second batch to answer two lines")
    x.run("batch", "cancel", second["id"])
    final = wait_for(
        lambda: (v := _status(x, second["id"]))["status"] == "cancelled" and v,
        120, "the cancelled batch to settle",
    )  # fmt: skip
    assert isinstance(final, dict)
    kept = x.run("batch", "results", second["id"]).stdout.splitlines()
    assert len(kept) == final["request_counts"]["completed"] >= 2
    deadline = time.monotonic() + 60
    while _tasks(second["job_id"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _tasks(second["job_id"]) == [], "the cancelled array left tasks behind"
