"""submitit pipelines on the dev cluster (examples/pipeline/submitit_eval.py, run as a researcher
runs it from the login node): a submitit job that serves the tiny model on its own GPU with
``xhpc.local``, and a submitit job array whose tasks each ask a lab deployment through
``xhpc.connect``. Both ask the same questions greedily of the same model and engine, so their
answers agree; the control token is in none of submitit's files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_python_api import ON_THE_BRIDGE, _final_state
from tests.conftest import ROOT, own_xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

EXAMPLE = ROOT / "examples" / "pipeline" / "submitit_eval.py"


def _start(env: dict[str, str], folder: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--folder", str(folder), "--partition", "gpu", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _result(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_a_submitit_job_serves_in_its_allocation_and_a_job_array_calls_the_lab(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    name = unique_name
    with own_xhpc(tiny_model, ON_THE_BRIDGE) as x:
        env = {**slurm_env(), **x.env}
        x.run("serve", "tiny-llama", "--name", name, "--engine", "transformers", "--detach")
        local = _start(env, tmp_path / "local", "--engine", "transformers", "local", "tiny-llama")
        try:
            wait_for(
                lambda: any(r["state"] == "READY" for r in x.json("ps", "--json")
                            if r["deployment"] == name),
                300, "the lab's deployment READY",
            )  # fmt: skip
            array = _result(_start(env, tmp_path / "array", "array", name), 420)
            here = _result(local, 420)
        finally:
            if local.poll() is None:
                local.kill()
                local.communicate()
        assert len(array["answers"]) == 3 and all(array["answers"]), array
        assert here["answers"] == array["answers"]  # the same model, engine and greedy questions
        assert len(here["gpus"]) == 1, here
        # one job for the local server, an array of three tasks for the questions
        (job,) = here["jobs"]
        tasks = array["jobs"]
        assert len(tasks) == 3 and len({t.split("_")[0] for t in tasks}) == 1, tasks
        for j in [job, *tasks]:
            assert wait_for(lambda j=j: _final_state(j), 60, f"job {j} ended") == "COMPLETED"
        token = (x.state_dir / "control.token").read_text().strip()
        for f in tmp_path.rglob("*"):
            if f.is_file():
                assert token.encode() not in f.read_bytes(), f
        x.run("stop", name)
        x.wait_no_jobs(120)
