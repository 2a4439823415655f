"""Pilot allocations on the real cluster: one job holds a node's GPUs and runs several replicas;
its agent picks their GPUs idle-first, honours pins, and refuses with "No available slot".

The engine is tests/data/engines/echo_engine.py: it answers chat requests with the GPUs it was
given (CUDA_VISIBLE_DEVICES), so the test sees what each replica's engine really got.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import ROOT, Xhpc, _start_xhpc, _teardown_xhpc, wait_for

pytestmark = pytest.mark.cluster

ECHO = ROOT / "tests" / "data" / "engines" / "echo_engine.py"
ECHO_ENGINE = f"""
[engines.command]
command = ["{sys.executable}", "{ECHO}", "--port", "{{port}}", "--served-model", "{{served_model}}"]
startup_timeout_s = 60
"""


@pytest.fixture
def xhpc_echo(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE)
    yield x
    _teardown_xhpc(x)


def _serve(x: Xhpc, name: str, *args: str, check: bool = True) -> dict[str, Any]:
    proc = x.run(
        "serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90",
        "--json", *args, check=check,
    )  # fmt: skip
    if not check:
        return {"returncode": proc.returncode, "stderr": proc.stderr}
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _replicas(x: Xhpc, *names: str) -> dict[str, dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(x.run("ps", "--all", "--json").stdout)
    return {str(r["replica_id"]): r for r in rows if r["deployment"] in names}


def _pilots(x: Xhpc) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads(x.run("ps", "--pilots", "--json").stdout)
    return out


def test_pilot_packs_pins_and_refuses_when_full(xhpc_echo: Xhpc, unique_name: str) -> None:
    x = xhpc_echo
    a, b, c = f"{unique_name}a", f"{unique_name}b", f"{unique_name}c"
    # Three replicas in one pilot holding all of n2's GPUs; the last one pinned to GPU 3.
    _serve(
        x, a, "--pilot", "n2", "--replicas", "3",
        "--replica-config", "gpus=1", "--replica-config", "gpus=1",
        "--replica-config", "gpu_idx=3",
    )  # fmt: skip
    reps = _replicas(x, a)
    assert {r["state"] for r in reps.values()} == {"READY"}
    jobs = {r["job_id"] for r in reps.values()}
    assert len(jobs) == 1 and x.my_jobs() == list(jobs)  # one Slurm job for three replicas
    gpus = {rid: tuple(r["gpus"]) for rid, r in reps.items()}
    assert gpus[f"{a}-2"] == (3,)  # the pin
    assert sorted(g for gs in gpus.values() for g in gs) == [0, 1, 3]  # disjoint, idle-first
    assert {r["node"] for r in reps.values()} == {"n2"}

    # Each engine really got its own GPU: the echo engine answers with CUDA_VISIBLE_DEVICES.
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)
    seen: set[str] = set()

    def all_answer() -> bool:
        try:
            reply = client.chat.completions.create(
                model=a, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        except openai.APIError:
            return False
        seen.add(reply.choices[0].message.content or "")
        return seen == {"gpus=0", "gpus=1", "gpus=3"}

    wait_for(all_answer, 30, "every replica's engine to answer with its own GPU")

    # A second deployment joins the same pilot and gets the last free GPU.
    _serve(x, b, "--pilot", "n2")
    (rb,) = _replicas(x, b).values()
    assert rb["job_id"] in jobs and rb["gpus"] == [2]

    # The pilot is full and gpu sharing is off: its agent refuses, nothing else changes.
    full = _serve(x, c, "--pilot", "n2", check=False)
    assert full["returncode"] != 0
    assert "No available slot" in str(full["stderr"]), full["stderr"]
    assert {r["state"] for r in _replicas(x, a, b).values()} == {"READY"}
    assert [r["state"] for r in _replicas(x, c).values()] == ["FAILED"]

    # Stopping one replica frees its GPU; the pilot job keeps serving the others.
    x.run("stop", f"{a}-0")
    wait_for(lambda: _replicas(x, a)[f"{a}-0"]["state"] == "STOPPED", 30, f"{a}-0 to stop")
    assert x.my_jobs() == list(jobs)
    _serve(x, c, "--pilot", "n2")
    (rc,) = (r for r in _replicas(x, c).values() if r["state"] == "READY")
    assert rc["job_id"] in jobs and rc["gpus"] == [0]

    # No replica left: xhpc cancels the pilot's job.
    for name in (a, b, c):
        x.run("stop", name)
    wait_for(lambda: not x.my_jobs(), 60, "the empty pilot's job to end")
    wait_for(lambda: not _pilots(x), 30, "the pilot to be gone from `xhpc ps --pilots`")


def test_pin_outside_the_pilots_allocation_is_refused_in_job(
    xhpc_echo: Xhpc, unique_name: str
) -> None:
    x = xhpc_echo
    # A pilot holding 2 of n3's 4 GPUs; Slurm picks which. A pin on a GPU the job cannot see
    # passes admission (n3 has GPU 3) but the pilot's agent, authoritative in its allocation,
    # refuses it.
    pilots_before = {p["pilot_id"] for p in _pilots(x)}
    res = _serve(
        x, unique_name, "--pilot", "n3", "--pilot-gpus", "2",
        "--replica-config", "gpu_idx=0", "--replica-config", "gpu_idx=3", check=False,
    )  # fmt: skip
    assert res["returncode"] != 0
    # The pilot's job sees two GPUs: GPU 0 and GPU 3 are never both among them.
    reps = _replicas(x, unique_name)
    failed = [r for r in reps.values() if r["state"] == "FAILED"]
    assert failed and all("not in this pilot's allocation" in str(r["reason"]) for r in failed)
    new = [p for p in _pilots(x) if p["pilot_id"] not in pilots_before]
    assert len(new) == 1 and new[0]["gpus"] == 2 and len(new[0]["devices"]) == 2
    x.run("stop", unique_name)
    wait_for(lambda: not x.my_jobs(), 60, "the pilot's job to end")


def test_pilot_admission_names_every_problem(xhpc_echo: Xhpc, unique_name: str) -> None:
    x = xhpc_echo
    res = _serve(
        x, unique_name, "--pilot", "n1", "--pilot-gpus", "2", "--replicas", "3",
        "--nodelist", "n2", check=False,
    )  # fmt: skip
    assert res["returncode"] != 0
    err = str(res["stderr"])
    assert "--pilot and --nodelist" in err
    assert "No available slot" in err and "holds 2" in err
    assert not x.my_jobs()
