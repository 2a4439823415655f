"""The Python API on the real dev cluster with a real engine: `xhpc.serve` as a context manager
on the login node, and the pipeline example as an sbatch job on a compute node, which reaches
the broker over TCP with the control token and the proxy on the cluster's address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

import xhpc
from tests.conftest import ROOT, SITE, Xhpc, own_xhpc, slurm_env, wait_for
from xhpc.config import load_config
from xhpc.errors import NotFoundError

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

# The dev cluster's login address: jobs on its nodes reach the broker and this proxy there.
ON_THE_BRIDGE = """
[proxy]
host = "10.77.0.1"
"""


def _rows(x: Xhpc, name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(x.run("ps", "--all", "--json").stdout)
    return [r for r in rows if r["deployment"] == name]


def test_serve_as_a_context_manager_answers_at_once_and_stops_at_the_end(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    name = unique_name
    with own_xhpc(tiny_model) as x:
        cfg = load_config(env=x.env)[0]
        with xhpc.serve(
            "tiny-llama", name=name, engine="transformers", timeout_s=180, config=cfg
        ) as dep:
            # READY means routed: the very first request through the proxy is answered.
            chat = dep.openai(max_retries=0).chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert chat.choices[0].message.content
            (replica,) = dep.replicas()
            assert replica.state.value == "READY" and replica.job_id in x.my_jobs()
            same = xhpc.connect(name, config=cfg)
            assert same.status().name == name and same.base_url == dep.base_url
            assert list(dep.logs(lines=50)) == [replica.replica_id]
            with pytest.raises(NotFoundError):
                xhpc.connect(f"{name}-none", config=cfg)
        # Leaving the block stopped it: replicas STOPPED, no job left.
        assert {r["state"] for r in _rows(x, name)} == {"STOPPED"}
        wait_for(lambda: not x.my_jobs(), 60, "the deployment's job to end")

        def unknown() -> bool:
            try:
                dep.openai(max_retries=0).chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            except openai.APIStatusError as err:
                return err.status_code == 404
            return False

        wait_for(unknown, 10, "the proxy to forget the stopped deployment")


def test_the_pipeline_example_serves_evaluates_and_stops_from_an_sbatch_job(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    name = unique_name
    out = tmp_path / "eval"
    with own_xhpc(tiny_model, ON_THE_BRIDGE) as x:
        env = {
            **slurm_env(),
            **x.env,
            "PYTHON": sys.executable,
            "EVAL_ARGS": f"--engine transformers --name {name}",
        }
        log = _run_example("eval.sbatch", out, env, tmp_path / "job.out")
        summary = json.loads((out / "summary.json").read_text())
        assert summary["deployment"] == name
        assert summary["answered"] == summary["questions"] == 5, summary
        answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
        assert [a["id"] for a in answers] == list(range(5))
        assert all(isinstance(a["answer"], str) and a["answer"] for a in answers)
        # The job stopped its model on the way out, and the control token never left its file.
        assert {r["state"] for r in _rows(x, name)} == {"STOPPED"}
        token = (x.state_dir / "control.token").read_text().strip()
        assert os.stat(x.state_dir / "control.token").st_mode & 0o777 == 0o600
        for seen in (log, (x.state_dir / "broker.log").read_text(errors="replace")):
            assert token not in seen


def test_in_allocation_serving_runs_two_engines_on_the_jobs_own_gpus_with_no_broker(
    dev_cluster: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The in-allocation example as an sbatch job with two GPUs: `xhpc run-server` and
    `xhpc.local` each take one, the same greedy questions get the same answers from both, and
    both engines are gone when the job ends. No broker runs for this test at all."""
    out = tmp_path / "local"
    state = tmp_path / "state"  # empty: nothing may be written to a broker's state
    env = {k: v for k, v in slurm_env().items() if not k.startswith("XHPC_")}
    env.update(
        XHPC_SITE_CONFIG=str(SITE),
        XHPC_STATE_DIR=str(state),
        XHPC_MODELS_DIR=str(tiny_model.parent),
        PYTHON=sys.executable,
        SERVER_ARGS="--engine transformers",
        EVAL_ARGS="--engine transformers",
    )
    _run_example("local.sbatch", out, env, tmp_path / "job.out")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agree"] is True and summary["questions"] == 3, summary
    assert all(isinstance(a, str) and a for a in summary["answers"]), summary
    assert len(summary["local_gpus"]) == len(summary["server_gpus"]) == 1, summary
    assert summary["local_gpus"] != summary["server_gpus"], summary  # one GPU each
    assert not state.exists() or not any(state.glob("*.sock")), "a broker was started"


def _run_example(script: str, out: Path, env: dict[str, str], output: Path) -> str:
    """Submit examples/pipeline/SCRIPT OUT as a job; its output once it COMPLETED."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--output", str(output), f"examples/pipeline/{script}", str(out)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    done = wait_for(lambda: _final_state(job), 420, f"the {script} job")
    log = output.read_text(errors="replace")
    assert done == "COMPLETED", log
    return log


def _final_state(job: str) -> str | None:
    """The job's state once it has ended (sacct), else None."""
    got = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"],
        env=slurm_env(), capture_output=True, text=True,
    )  # fmt: skip
    lines = got.stdout.strip().splitlines()
    state = lines[0].split()[0] if lines else "PENDING"
    return None if state in ("PENDING", "RUNNING", "REQUEUED") else state
