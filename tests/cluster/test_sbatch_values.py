"""What Slurm parses from xhpc's job scripts is exactly what xhpc meant, on the real sbatch.

Slurm reads ``#SBATCH`` lines with its own parser, which honours a backslash inside quotes: shell
quoting never protected them (xhpc.sbatch_values). Each job kind xhpc renders (a replica, a pilot,
a PD unit's hetjob, a batch's array, a weights-cache job) is submitted held, with values at the
edges of the allow-list, and ``scontrol show job`` must show exactly those options; then it is
cancelled. The values that broke out of their line before are refused before a script exists.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.conftest import slurm_env
from xhpc.render import (
    BatchSbatchParams,
    CacheSbatchParams,
    PdComponent,
    PdSbatchParams,
    SbatchParams,
    render_batch_sbatch,
    render_cache_sbatch,
    render_pd_sbatch,
    render_sbatch,
)

pytestmark = [pytest.mark.cluster, pytest.mark.adversarial, pytest.mark.security]

# A value that broke out of a shell-quoted #SBATCH line (the injection of the review).
INJECTION = "x\\'' --job-name=INJECTED #"


@pytest.fixture
def held(tmp_path: Path) -> Iterator[list[str]]:
    """Job ids submitted held by the test, cancelled however it ends."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], env=slurm_env(), check=False)


def _submit_held(script: str, path: Path, ids: list[str]) -> list[dict[str, str]]:
    """Submit ``script`` held; every component's fields as `scontrol show job -o` reads them."""
    path.write_text(script)
    done = subprocess.run(["sbatch", "--hold", "--parsable", str(path)], env=slurm_env(),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    ids.append(job)
    shown = subprocess.run(["scontrol", "show", "job", job, "-o"], env=slurm_env(),
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [_fields(line) for line in shown.splitlines() if line.strip()]


def _fields(line: str) -> dict[str, str]:
    """``Key=Value`` pairs of one `scontrol -o` line (values may hold blanks: read up to the
    next `` Key=``)."""
    pairs = re.findall(r"(\w+(?::\w+)?)=(.*?)(?= \w+(?::\w+)?=|$)", line)
    return {key: value.strip() for key, value in pairs}


def test_slurm_honours_a_backslash_inside_a_shell_quoted_sbatch_value(
    tmp_path: Path, held: list[str]
) -> None:
    """Failed on 6d94085 before the fix: the renderer shell-quoted such a value onto its
    #SBATCH line, and Slurm's parser took the quoted part apart and added the option after it
    (here --job-name; with --export or --qos, the review ran code as the broker's user)."""
    line = f"#SBATCH --comment={shlex.quote(INJECTION)}"  # how values were written before
    script = f"#!/bin/bash\n#SBATCH --job-name=meant\n{line}\n#SBATCH --time=00:05:00\ntrue\n"
    (job,) = _submit_held(script, tmp_path / "old.sbatch", held)
    assert job["JobName"] == "INJECTED"  # Slurm's own parser, not xhpc: why quoting is no wall
    for field in ("comment", "partition", "job_name", "time", "account", "nodelist"):
        with pytest.raises(ValidationError, match="invalid"):
            SbatchParams(**{**_replica(tmp_path, "r"), field: INJECTION})
    with pytest.raises(ValueError, match="#SBATCH line"):
        render_sbatch(SbatchParams.model_construct(**{**_replica(tmp_path, "r"),
                                                      "comment": INJECTION}))  # fmt: skip


def _replica(tmp_path: Path, rid: str) -> dict[str, object]:
    tag = uuid.uuid4().hex[:6]
    return {
        "replica_id": rid, "deployment": "m.v-1_2", "job_name": f"xhpc-{tag}.r_1-2",
        "comment": f"xhpc:b{tag}:m.v-1_2:{rid}@n+1=2", "gpus": 1, "partition": "gpu",
        "account": "lab1", "time": "0-00:10:00", "nodelist": "n2", "cpus": 1,
        "mem_mb": 100, "output": str(tmp_path / "out,a@b+c=d:%j.log"),
        "agent_python": "/usr/bin/python3", "replica_dir": str(tmp_path / rid),
    }  # fmt: skip


def test_a_replica_and_a_pilot_reach_slurm_with_exactly_their_options(
    tmp_path: Path, held: list[str]
) -> None:
    for pilot in (False, True):
        params = SbatchParams(**_replica(tmp_path, "r-0"), pilot=pilot)
        (job,) = _submit_held(render_sbatch(params), tmp_path / "r.sbatch", held)
        assert job["JobName"] == params.job_name
        assert job["Comment"] == params.comment
        assert job["Partition"] == "gpu" and job["Account"] == "lab1"
        assert job["TimeLimit"] == "00:10:00"
        assert job["ReqNodeList"] == "n2"
        assert job["StdOut"] == params.output.replace("%j", job["JobId"])
        assert job["Requeue"] == "1"
        assert "gres/gpu=1" in job["TresPerNode"] or job["TresPerNode"] == "gres:gpu:1"
        assert job["Command"] == str(tmp_path / "r.sbatch")


def test_a_pd_unit_reaches_slurm_as_one_hetjob_with_exactly_its_components(
    tmp_path: Path, held: list[str]
) -> None:
    base = _replica(tmp_path, "u-0")
    comps = tuple(
        PdComponent(
            replica_id=f"u-0-{role}",
            role=role,
            gpus=1,
            nodelist=node,
            cpus=1,
            replica_dir=str(tmp_path / role),
        )
        for role, node in (("prefill", "n1"), ("decode", "n2"))
    )
    params = PdSbatchParams(
        unit_id="u-0", deployment="m", job_name=str(base["job_name"]),
        comment=str(base["comment"]), partition="gpu", account="lab1", time="00:10:00",
        output=str(base["output"]), agent_python="/usr/bin/python3", components=comps,
    )  # fmt: skip
    jobs = _submit_held(render_pd_sbatch(params), tmp_path / "pd.sbatch", held)
    assert [j["HetJobOffset"] for j in jobs] == ["0", "1"]
    assert [j["ReqNodeList"] for j in jobs] == ["n1", "n2"]
    for job in jobs:
        assert job["JobName"] == params.job_name and job["Comment"] == params.comment
        assert job["Partition"] == "gpu" and job["Account"] == "lab1"
        assert job["TimeLimit"] == "00:10:00" and job["Requeue"] == "0"


def test_a_batch_array_and_a_cache_job_reach_slurm_with_exactly_their_options(
    tmp_path: Path, held: list[str]
) -> None:
    base = _replica(tmp_path, "b")
    batch = BatchSbatchParams(
        batch_id="batch_0123", job_name="xhpc-batch-0123", comment=str(base["comment"]),
        last_task=2, gpus=1, partition="gpu", qos="normal", account="lab1", time="00:10:00",
        output=str(tmp_path / "slurm-%A_%a.out"), python="/usr/bin/python3",
        batch_dir=str(tmp_path / "b"),
    )  # fmt: skip
    jobs = _submit_held(render_batch_sbatch(batch), tmp_path / "batch.sbatch", held)
    assert {j["ArrayTaskId"] for j in jobs} == {"0-2"}
    (job,) = jobs
    assert job["JobName"] == batch.job_name and job["QOS"] == "normal"
    assert job["Partition"] == "gpu" and job["Account"] == "lab1"
    assert job["TimeLimit"] == "00:10:00"
    cache = CacheSbatchParams(
        job_name="xhpc-cache-pull-m", comment=str(base["comment"]), action="pull",
        args=("/src dir/it's", "/models"), partition="gpu", account="lab1", nodelist="n3",
        output=str(tmp_path / "pull-%j.out"), agent_python="/usr/bin/python3",
    )  # fmt: skip
    (job,) = _submit_held(render_cache_sbatch(cache), tmp_path / "cache.sbatch", held)
    assert job["JobName"] == cache.job_name and job["ReqNodeList"] == "n3"
    assert job["TimeLimit"] == "00:30:00"
