"""Per-job tokens stay secret; a broker restart drops no traffic and relaunches nothing."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import Xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


def _serve_one(x: Xhpc, name: str) -> dict[str, object]:
    dep = x.json(
        "serve", "tiny-llama", "--name", name, "--engine", "transformers", "--timeout", "240"
    )
    (replica,) = dep["replicas"]
    assert replica["state"] == "READY"
    return replica


def _chat(x: Xhpc, name: str) -> str:
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    return reply.choices[0].message.content or ""


def _wait_routed(x: Xhpc, name: str) -> None:
    def ok() -> bool:
        try:
            return bool(_chat(x, name))
        except openai.InternalServerError:
            return False

    wait_for(ok, 30, "the proxy to route the model")


def _node_pids(node: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", f"xhpc-{node}"], capture_output=True, text=True, check=True
    ).stdout
    return [int(p) for p in out.split()]


def test_job_token_never_leaks(xhpc: Xhpc, unique_name: str) -> None:
    replica = _serve_one(xhpc, unique_name)
    rdir = xhpc.state_dir / "replicas" / str(replica["replica_id"])
    token = (rdir / "token").read_text().strip()
    assert len(token) >= 32
    assert (rdir / "token").stat().st_mode & 0o077 == 0
    assert rdir.stat().st_mode & 0o077 == 0
    job_id = str(replica["job_id"])
    places = {
        "sbatch script": (rdir / "job.sbatch").read_text(),
        "scontrol show job -d": subprocess.run(
            ["scontrol", "show", "job", "-d", job_id],
            env=slurm_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout,
        "batch script held by Slurm": subprocess.run(
            ["scontrol", "write", "batch_script", job_id, "-"],
            env=slurm_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout,
    }
    for path in [
        *rdir.glob("slurm-*.out"),
        *rdir.glob("engine-*.log"),
        *xhpc.state_dir.glob("*.log"),
    ]:
        places[str(path)] = path.read_text(errors="replace")
    # The job's processes on its node: argv and environment.
    for pid in _node_pids(str(replica["node"])):
        for what in ("cmdline", "environ"):
            try:
                places[f"/proc/{pid}/{what}"] = (
                    Path(f"/proc/{pid}/{what}").read_bytes().decode(errors="replace")
                )
            except OSError:
                continue
    # We really looked at the job's own processes (agent and engine) and its output files.
    cmdlines = [t for w, t in places.items() if w.endswith("/cmdline")]
    assert any("xhpc.agent" in t for t in cmdlines) and any("serve" in t for t in cmdlines)
    assert any(w.endswith(".out") for w in places) and any(w.endswith("broker.log") for w in places)
    leaks = [where for where, text in places.items() if token in text]
    assert leaks == []
    # The replica's engine secret (which the proxy presents) leaks nowhere either: the guard
    # in front of transformers holds it in memory only.
    secret = (rdir / "engine_secret").read_text().strip()
    assert len(secret) >= 32 and (rdir / "engine_secret").stat().st_mode & 0o077 == 0
    assert [where for where, text in places.items() if secret in text] == []
    # Its node port refuses anyone without the secret; the proxy, which has it, gets through.
    (row,) = [r for r in xhpc.json("ps") if r["replica_id"] == replica["replica_id"]]
    chat = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
    url = f"http://{row['host']}:{row['port']}/v1/chat/completions"
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        raw = urllib.request.Request(
            url, data=chat, method="POST", headers={"Content-Type": "application/json", **auth}
        )
        with pytest.raises(urllib.error.HTTPError) as closed:
            urllib.request.urlopen(raw, timeout=10)
        assert closed.value.code == 401
    _wait_routed(xhpc, unique_name)
    # The agent API refuses a caller without the replica's token.
    agent_url = json.loads((xhpc.state_dir / "broker.json").read_text())["agent_url"]
    body = json.dumps(
        {
            "replica_id": replica["replica_id"],
            "job_id": job_id,
            "phase": "failed",
            "detail": "forged",
        }
    ).encode()
    req = urllib.request.Request(
        f"{agent_url}/agent/v1/report",
        data=body,
        method="POST",
        headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401
    (row,) = [r for r in xhpc.json("ps") if r["replica_id"] == replica["replica_id"]]
    assert row["state"] == "READY"


def test_broker_restart_keeps_traffic_and_relaunches_nothing(xhpc: Xhpc, unique_name: str) -> None:
    replica = _serve_one(xhpc, unique_name)
    _wait_routed(xhpc, unique_name)
    jobs_before = sorted(xhpc.my_jobs())
    broker = xhpc.procs[0]
    broker.terminate()
    broker.wait(15)
    # The proxy serves from its last known routing table while the broker is down.
    for _ in range(5):
        assert _chat(xhpc, unique_name)
    xhpc.start("broker")
    wait_for(lambda: xhpc.run("ps", check=False).returncode == 0, 20, "the new broker")
    for _ in range(5):
        assert _chat(xhpc, unique_name)
    (row,) = [r for r in xhpc.json("ps") if r["replica_id"] == replica["replica_id"]]
    assert row["state"] == "READY" and row["job_id"] == replica["job_id"]
    assert sorted(xhpc.my_jobs()) == jobs_before
    stopped = xhpc.json("stop", unique_name)
    assert {r["state"] for r in stopped} == {"STOPPED"}
