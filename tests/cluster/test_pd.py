"""Prefill/decode units on the real cluster with real vLLM on CPU: one heterogeneous job per
unit, its components on different nodes; the proxy's two-phase route; the KV really moves.

ExampleConnector (KV through files in the unit's shared directory, idle engines) carries the
cheaper tests; NixlConnector (the production connector, busy-polling on CPU) carries the proof
that the decode instance loaded the prefill's KV. No latency is asserted anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.traffic import Traffic
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc, own_xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

EXAMPLE_CONNECTOR = """
[pd]
connector = "ExampleConnector"
kv_buffer_device = ""

[pd.extra_config]
shared_storage_path = "{unit_dir}/kv"
"""
# Longer than one 32-token block, so that the prefill's KV is worth transferring.
PROMPT = (
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly "
    "and a wizard's job is to vex chumps quickly in fog; pack my box with five dozen liquor "
    "jugs, then sphinx of black quartz, judge my vow. Tell me what happens next:"
)


@pytest.fixture
def xhpc_example(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, EXAMPLE_CONNECTOR)
    yield x
    _teardown_xhpc(x)


def _rows(x: Xhpc, name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(x.run("ps", "--all", "--json").stdout)
    return [r for r in rows if r["deployment"] == name]


def _hetjob(job_id: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["squeue", "--json"], env=slurm_env(), capture_output=True, text=True, check=True
    ).stdout
    # squeue --json of Slurm 22.05 also lists ended jobs: keep the live ones.
    live = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}
    return [
        j
        for j in json.loads(out)["jobs"]
        if str(j.get("het_job_id")) == job_id and j.get("job_state") in live
    ]


def _serve_unit(x: Xhpc, name: str, *extra: str) -> list[dict[str, Any]]:
    x.run(
        "serve", "tiny-llama", "--name", name, "--engine", "vllm", "--pd", "1P1D",
        "--timeout", "400", *extra,
    )  # fmt: skip
    rows = _rows(x, name)
    assert sorted((r["role"], r["state"]) for r in rows) == [
        ("decode", "READY"),
        ("prefill", "READY"),
    ]
    return rows


def _transferred(decode: dict[str, Any]) -> float:
    """Prompt tokens the decode instance took from the KV transfer (its own /metrics)."""
    with urllib.request.urlopen(f"http://{decode['host']}:{decode['port']}/metrics") as resp:
        metrics = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total")
        and 'source="external_kv_transfer"' in line
    )


def _client(x: Xhpc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)


def _wait_routed(x: Xhpc, name: str) -> None:
    def ok() -> bool:
        try:
            return bool(_client(x).completions.create(model=name, prompt="hi", max_tokens=1))
        except openai.APIError:
            return False

    wait_for(ok, 60, "the proxy to route the PD unit")


def test_nixl_moves_the_kv_and_keeps_greedy_output(xhpc: Xhpc, unique_name: str) -> None:
    """Through the two-phase route the output is what one instance alone computes: the unit's
    prefill instance, asked directly (with its own secret) for the whole completion, is that
    instance (the same engine, model and arguments as a plain replica)."""
    x, name = xhpc, unique_name
    rows = _serve_unit(x, name)
    _wait_routed(x, name)
    client = _client(x)
    (prefill,) = [r for r in rows if r["role"] == "prefill"]
    alone = openai.OpenAI(
        base_url=f"http://{prefill['host']}:{prefill['port']}/v1",
        api_key=_engine_secret(x, prefill["replica_id"]),
        max_retries=0,
    )

    def greedy(on: openai.OpenAI, model: str) -> str:
        out = on.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        return out.choices[0].text

    through_pd = greedy(client, name)
    assert through_pd and through_pd == greedy(alone, name)  # it serves under the name
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    # The decode instance took the prompt's KV from the transfer, not from its own prefill.
    (decode,) = [r for r in rows if r["role"] == "decode"]
    assert _transferred(decode) > 0
    x.run("stop", name)


def _engine_secret(x: Xhpc, replica_id: str) -> str:
    """An instance's engine secret, from its owner-only directory (the test is its owner)."""
    (path,) = x.state_dir.rglob(f"{replica_id}/engine_secret")
    return path.read_text().strip()


def _engine_pid(port: int) -> int:
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            return int(proc.name)
    raise AssertionError(f"no vLLM engine on port {port}")


def _live_units(x: Xhpc, name: str) -> set[str]:
    return {r["unit"] for r in _rows(x, name) if r["state"] not in ("STOPPED", "FAILED")}


def _check_one_hetjob_and_the_two_phase_route(
    x: Xhpc, name: str, rows: list[dict[str, Any]]
) -> None:
    """One heterogeneous job in squeue, its two components on two nodes, each with its GPU;
    it answers through the two-phase route and the KV really moved."""
    (unit,) = {r["unit"] for r in rows}
    leader = {r["job_id"].split("+")[0] for r in rows}
    assert len(leader) == 1 and sorted(r["job_id"] for r in rows) == [
        f"{next(iter(leader))}+0",
        f"{next(iter(leader))}+1",
    ]
    comps = _hetjob(next(iter(leader)))
    assert sorted(j["het_job_offset"] for j in comps) == [0, 1]
    assert len({j["nodes"] for j in comps}) == 2
    assert all(j["gres_detail"] for j in comps)
    _wait_routed(x, name)
    client = _client(x)
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    streamed = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    # The prefill wrote the prompt's KV into the unit's own shared directory; the decode
    # instance read it from there (prefill first, then decode).
    kv = x.state_dir / "units" / unit / "kv"
    assert kv.is_dir() and any(kv.rglob("*")), f"no KV files under {kv}"
    (decode,) = [r for r in rows if r["role"] == "decode"]
    assert _transferred(decode) > 0


def test_a_unit_is_one_hetjob_admitted_replaced_and_scaled_whole(
    xhpc_example: Xhpc, unique_name: str
) -> None:
    x, name = xhpc_example, unique_name
    # A unit that can never fit is refused before anything is submitted.
    refused = x.run(
        "serve", "tiny-llama", "--name", f"{name}x", "--engine", "vllm", "--pd", "1P1D",
        "--decode-gpus", "8", check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "no decode instance fits: 8 GPU(s)" in refused.stderr
    assert not x.my_jobs()
    rows = _serve_unit(x, name)
    _check_one_hetjob_and_the_two_phase_route(x, name, rows)
    (first,) = {r["unit"] for r in rows}
    old_job = rows[0]["job_id"].split("+")[0]
    # The decode instance's engine dies: the unit is degraded, its hetjob ends, a new unit
    # (a new hetjob) replaces it and becomes READY.
    (decode,) = [r for r in rows if r["role"] == "decode"]
    os.kill(_engine_pid(int(decode["port"])), signal.SIGKILL)

    def replaced() -> bool:
        live = [r for r in _rows(x, name) if r["unit"] != first]
        return len(live) == 2 and all(r["state"] == "READY" for r in live)

    wait_for(replaced, 400, "a new unit to replace the degraded one")
    wait_for(lambda: not _hetjob(old_job), 60, "the degraded unit's hetjob to end")
    assert _live_units(x, name) == {f"{name}-u1"}
    # Scale by whole units: 1 -> 2 adds a hetjob, 2 -> 1 drains and ends one.
    up = json.loads(x.run("scale", name, "2", "--timeout", "400", "--json").stdout)
    assert len(up["added"]) == 2 and _live_units(x, name) == {f"{name}-u1", f"{name}-u2"}
    assert len(x.my_jobs()) == 4  # two hetjobs of two components each
    down = json.loads(x.run("scale", name, "1", "--timeout", "120", "--json").stdout)
    assert len(down["removed"]) == 2
    wait_for(lambda: len(x.my_jobs()) == 2, 60, "the removed unit's hetjob to end")
    assert len(_live_units(x, name)) == 1
    _wait_routed(x, name)
    # The unit is all or nothing: stopping one instance ends the whole hetjob.
    live = [r for r in _rows(x, name) if r["state"] == "READY"]
    leader = live[0]["job_id"].split("+")[0]
    x.run("stop", live[0]["replica_id"])
    wait_for(lambda: not _hetjob(leader), 60, "the unit's hetjob to end")
    wait_for(
        lambda: (
            {r["state"] for r in _rows(x, name) if r["unit"] == live[0]["unit"]}
            <= {"STOPPED", "FAILED"}
        ),
        60,
        "both instances to stop",
    )
    x.run("stop", name)


# A 6-minute time limit and a handover lead of 5 minutes: each unit's successor is submitted as
# soon as the unit is READY (vLLM on CPU takes one to two minutes to start a unit), and must be
# READY before the time limit's warning (a minute before the end).
WALLTIME_UNITS = (
    EXAMPLE_CONNECTOR
    + """
[lifecycle]
handover_floor_s = 300
"""
)


@pytest.mark.chaos
def test_a_unit_hands_over_at_its_walltime_under_traffic(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    """A PD unit's hetjob reaches its time limit under steady traffic through the two-phase
    route: a successor unit (a new hetjob) starts before the end, takes the traffic when it is
    READY, the old unit drains and ends, and no request fails or is cut short."""
    name = unique_name
    with own_xhpc(tiny_model, WALLTIME_UNITS) as x:
        x.run(
            "serve", "tiny-llama", "--name", name, "--engine", "vllm", "--pd", "1P1D",
            "--timeout", "400", "--time", "00:06:00",
        )  # fmt: skip
        # Its successor may be on its way already (the lead is most of the job's time).
        (first_unit,) = {r["unit"] for r in _rows(x, name) if r["state"] == "READY"}
        first = {first_unit}
        old_job = next(r["job_id"] for r in _rows(x, name) if r["unit"] == first_unit)
        old_job = old_job.split("+")[0]
        _wait_routed(x, name)
        body = {"ignore_eos": True}  # exactly max_tokens tokens from the tiny model
        with Traffic(x.proxy_url, name, done_marker=True, extra=body) as load:

            def handed_over() -> bool:
                rows = _rows(x, name)
                ready = [r["unit"] for r in rows if r["state"] == "READY"]
                successor = any(u not in first and ready.count(u) == 2 for u in ready)
                old = [r for r in rows if r["unit"] in first]
                return successor and all(r["state"] in ("STOPPED", "DRAINING") for r in old)

            wait_for(handed_over, 420, "a successor unit READY and the first unit retired")
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 10, 120, "traffic after the handover")
        wait_for(lambda: not _hetjob(old_job), 120, "the first unit's hetjob to end")
        assert "action=successor" in (x.state_dir / "broker.log").read_text(errors="replace")
        assert load.truncated() == [], load.summary()
        assert load.failures() == [], load.summary()
        assert load.sent() > 20, load.summary()
        x.run("stop", name)
        wait_for(lambda: not x.my_jobs(), 60, "no job left")
