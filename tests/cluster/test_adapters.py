"""LoRA adapters on the dev cluster with real vLLM on CPU: a deployment with room for adapters
(`engine_config.lora`), a tiny random adapter (scripts/make-tiny-adapter) added by its owner,
loaded on the replica while it runs, routed by its name: its greedy answers differ from the
base's and equal the engine's own with that adapter; another user's key finds no such model;
it is served on by the replacement of a killed engine, and through a walltime handover under
traffic (the replacement's time limit shortened by the operator: no request fails), each new
replica holding it by the time it is READY; removed, it is gone from the gateway and the
engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.test_chaos import engine_pid, ready, replicas
from tests.cluster.traffic import Traffic
from tests.conftest import ROOT, Xhpc, own_xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine, pytest.mark.chaos]

CATALOG = """
[models.tiny-lora]
path = "{weights}"
engine = "vllm"

[models.tiny-lora.engine_config.lora]
max_loras = 2
max_lora_rank = 8

[lifecycle]
backoff_s = 1
lost_grace_s = 20
handover_floor_s = 180

[proxy]
auth = "keys"
"""
PROMPTS = ("The cluster", "Hello world, hello", "One, two, three,")


def _greedy(client: openai.OpenAI, model: str) -> list[str]:
    return [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]


def _key(x: Xhpc, user: str, account: str) -> str:
    made = json.loads(
        x.run("keys", "create", "--user", user, "--account", account, "--json").stdout
    )
    return str(made["key"])


def _view(x: Xhpc, name: str) -> dict[str, Any]:
    views = json.loads(x.run("adapters", "list", "--json").stdout)
    (view,) = [v for v in views if v["name"] == name]
    return dict(view)


def _engine(x: Xhpc, row: dict[str, Any]) -> openai.OpenAI:
    secret = (x.state_dir / "replicas" / row["replica_id"] / "engine_secret").read_text().strip()
    url = f"http://{row['host']}:{row['port']}/v1"
    return openai.OpenAI(base_url=url, api_key=secret, max_retries=0)


def _shorten(job_id: str, minutes_left: int) -> None:
    """The job's time limit set to ``minutes_left`` minutes after its elapsed time (root may)."""
    env = slurm_env()
    elapsed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%M"], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    parts = [int(p) for p in elapsed.replace("-", ":").split(":")]
    minutes = sum(v * m for v, m in zip(reversed(parts), (1 / 60, 1, 60, 1440), strict=False))
    limit = int(minutes) + 1 + minutes_left
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"], env=env,
                   check=True)  # fmt: skip


def _holds_it_from_ready(x: Xhpc, name: str, base: str, old: set[str]) -> dict[str, Any]:
    """The one READY replica of ``base`` not in ``old``, once the others retired: it held the
    adapter within 2 s of its READY."""

    def successor() -> dict[str, Any] | None:
        rows = replicas(x, base, all_=True)
        new = [r for r in rows if r["replica_id"] not in old and r["state"] == "READY"]
        gone = all(r["state"] in ("STOPPED", "DRAINING", "FAILED") for r in rows
                   if r["replica_id"] in old)  # fmt: skip
        return new[0] if len(new) == 1 and gone else None

    wait_for(lambda: successor() is not None, 400, "a new replica READY, the others retired")
    row = successor()
    assert row is not None
    view = _view(x, name)
    assert row["replica_id"] in view["loaded_on"], view
    assert view["load_s"][row["replica_id"]] <= 2.0, view
    return row


def test_an_adapter_is_served_by_its_name_through_a_handover_and_a_replacement(
    dev_cluster: Path, tiny_model: Path, tmp_path: Path, unique_name: str
) -> None:
    adapter = tmp_path / "a1"
    subprocess.run([str(ROOT / "scripts" / "make-tiny-adapter"), str(adapter)], check=True)
    base, name = unique_name, f"{unique_name}-a1"
    with own_xhpc(tiny_model, CATALOG.format(weights=tiny_model)) as x:
        x.run("serve", "tiny-lora", "--name", base, "--timeout", "400")
        x.run("adapters", "add", name, "--base", base, "--path", str(adapter))
        mine, other = _key(x, "root", "lab1"), _key(x, "xhpc-member", "lab2")
        gateway = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key=mine, max_retries=0)
        wait_for(lambda: bool(_view(x, name)["loaded_on"]), 30, "the adapter loaded")

        def routed() -> bool:  # listed with its parent by every proxy worker
            return all(
                getattr({m.id: m for m in gateway.models.list().data}.get(name), "parent", None)
                == base
                for _ in range(6)
            )

        wait_for(routed, 30, "the adapter routed")
        (first,) = ready(x, base)
        with_adapter = _greedy(gateway, name)
        assert with_adapter == _greedy(_engine(x, first), name)  # the engine's own answers
        assert with_adapter != _greedy(gateway, base)  # and not the base's

        # Another user's key: no such model.
        theirs = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key=other, max_retries=0)
        assert name not in {m.id for m in theirs.models.list().data}
        with pytest.raises(openai.NotFoundError):
            theirs.completions.create(model=name, prompt="hi", max_tokens=2)

        # Its engine killed: the replacement holds the adapter by the time it is READY.
        os.kill(engine_pid(first["replica_id"], str(first["job_id"])), signal.SIGKILL)
        repl = _holds_it_from_ready(x, name, base, {first["replica_id"]})

        def same() -> bool:  # every proxy worker routes it to the replacement
            try:
                return all(_greedy(gateway, name) == with_adapter for _ in range(2))
            except openai.APIError:
                return False

        wait_for(same, 60, "the same answers from the replacement")

        # Its job's time limit comes near under traffic on the adapter (an operator shortens
        # it to two or three minutes from now): a successor takes over; no request fails.
        body: dict[str, object] = {"ignore_eos": True, "temperature": 0}
        with Traffic(x.proxy_url, name, done_marker=True, extra=body, key=mine) as load:
            _shorten(str(repl["job_id"]), minutes_left=2)
            now = _holds_it_from_ready(x, name, base, {first["replica_id"], repl["replica_id"]})
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 3, 120, "traffic after the handover")
        assert load.truncated() == [], load.summary()
        assert load.failures() == [], load.summary()
        assert _greedy(gateway, name) == with_adapter
        assert "action=replace" in (x.state_dir / "broker.log").read_text()

        x.run("adapters", "rm", name)
        wait_for(
            lambda: name not in {m.id for m in gateway.models.list().data}, 30, "gone from gateway"
        )
        wait_for(
            lambda: name not in {m.id for m in _engine(x, now).models.list().data},
            30,
            "the adapter unloaded from the engine",
        )
        x.run("stop", base)
        x.wait_no_jobs(180)
