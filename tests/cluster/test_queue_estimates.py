"""Queue estimates on the real cluster: with every GPU held by plain jobs of a known time
limit, a served replica queues where `sbatch --test-only` expects it to start first, `xhpc ps`
shows Slurm's pending reason and start estimate, and once the blockers go it becomes READY
(with its job's time left). The `command` engine (tests/data/engines/echo_engine.py): no vLLM."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, own_xhpc, slurm_env, wait_for
from xhpc.slurm.estimate import parse_test_only

pytestmark = pytest.mark.cluster

NODES = ("n1", "n2", "n3")
BLOCKER = "xhpc-test-blocker"  # not an xhpc tag: no broker adopts or cancels these


@pytest.fixture
def blockers(dev_cluster: Path) -> Iterator[list[str]]:
    """One plain job per node holding its four GPUs, 10 minutes at most; cancelled however the
    test ends."""
    ids: list[str] = []
    try:
        for node in NODES:
            out = subprocess.run(
                ["sbatch", "--parsable", f"--job-name={BLOCKER}", "--gres=gpu:4",
                 f"--nodelist={node}", "--time=10", "--output=/dev/null", "--wrap", "sleep 600"],
                env=slurm_env(), check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            ids.append(out.strip().split(";")[0])

        def running() -> bool:
            out = subprocess.run(
                ["squeue", "-h", "-j", ",".join(ids), "-o", "%T"],
                env=slurm_env(), check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            return out.split() == ["RUNNING"] * len(ids)

        wait_for(running, 60, "the blockers to hold every GPU")
        yield ids
    finally:
        if ids:
            subprocess.run(["scancel", *ids], env=slurm_env(), check=False)


def _replica(x: Xhpc, replica_id: str) -> dict[str, Any]:
    rows = [r for r in x.json("ps", "--all") if r["replica_id"] == replica_id]  # type: ignore[union-attr]
    assert len(rows) == 1
    return rows[0]  # type: ignore[no-any-return]


def test_sbatch_test_only_answers_in_the_format_the_parser_reads(blockers: list[str]) -> None:
    env = {**slurm_env(), "SLURM_TIME_FORMAT": "%s"}
    done = subprocess.run(
        ["sbatch", "--test-only", "--gres=gpu:1", "--time=5", "--nodelist=n2", "--partition=gpu",
         "--wrap=true"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    est = parse_test_only(done.stderr)  # the real stderr (tests/data/slurm/sbatch-test-only.txt)
    assert est.nodes == "n2" and est.partition == "gpu", done.stderr
    assert est.start > datetime.now(UTC), done.stderr  # after a blocker's end, not now


def test_a_queued_replica_shows_its_wait_and_starts_when_the_gpus_free(
    blockers: list[str], tiny_model: Path, unique_name: str
) -> None:
    with own_xhpc(tiny_model, ECHO_ENGINE) as x:
        dep = x.json(
            "serve", "tiny-llama", "--name", unique_name, "--engine", "command", "--gpus", "1",
            "--time", "00:10:00", "--detach",
        )  # fmt: skip
        (r,) = dep["replicas"]  # type: ignore[index]
        rid = str(r["replica_id"])
        row = _replica(x, rid)
        assert row["state"] == "QUEUED"
        assert row["placed_node"] in NODES  # queued where Slurm expects the earliest start

        def estimated() -> dict[str, Any] | None:
            row = _replica(x, rid)
            out = row.get("outlook") or {}
            return row if out.get("pending_reason") and out.get("start_estimate") else None

        row = wait_for(estimated, 90, "Slurm's pending reason and start estimate in ps --json")
        assert row["outlook"]["pending_reason"] in ("Resources", "Priority", "ReqNodeNotAvail")
        shown = x.run("ps").stdout
        assert "starts in" in shown and row["outlook"]["pending_reason"] in shown, shown
        log = (x.state_dir / "broker.log").read_text()
        assert "expected to start first at" in log, log[-2000:]

        subprocess.run(["scancel", *blockers], env=slurm_env(), check=True)
        wait_for(lambda: _replica(x, rid)["state"] == "READY", 180, "the queued replica READY")
        left = _replica(x, rid)["outlook"]["time_left_s"]
        assert left is not None and 0 < left <= 600
        assert "left" in x.run("ps").stdout
        x.run("stop", unique_name)
        wait_for(lambda: not x.my_jobs(), 60, "no job left")
