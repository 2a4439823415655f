"""Admission on the real dev cluster (3 nodes x 4 untyped GPUs, partition `gpu`, MaxTime 1 day):
every refused request names all its problems on one line, exits 2 and submits nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import Xhpc
from xhpc.broker.admit.admission import admission_problems
from xhpc.config import SlurmConfig, XhpcConfig
from xhpc.models import EngineKind, NodeInfo, PartitionInfo, ServeRequest
from xhpc.slurm.client import CliSlurmClient
from xhpc.slurm.partitions import accounting_enabled

pytestmark = pytest.mark.cluster


def _refused(x: Xhpc, *args: str) -> str:
    proc = x.run("serve", "tiny-llama", *args, "--detach", check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert x.my_jobs() == []
    assert x.json("ps", "--all") == []
    return lines[0]


def test_reserved_engine_arg_is_refused(xhpc: Xhpc) -> None:
    line = _refused(xhpc, "--engine-arg", "--port", "--engine-arg", "9000")
    # The dev cluster's default engine is transformers.
    assert "engine argument(s) not allowed for transformers: --port (xhpc sets it)" in line
    assert "allowed: --attn-implementation" in line


def test_two_replicas_pinned_to_one_gpu_are_refused_naming_both(xhpc: Xhpc) -> None:
    pin = "node=n1,gpus=1,gpu_idx=1"
    line = _refused(xhpc, "--replica-config", pin, "--replica-config", pin)  # --replicas: 2
    assert "replicas 0 and 1 are both pinned to GPU 1 on n1 (gpu sharing is off)" in line
    assert "which needs --pilot" in line


def test_every_problem_of_a_multi_replica_request_at_once(xhpc: Xhpc) -> None:
    line = _refused(
        xhpc,
        "--replica-config",
        "node=n9",
        "--replica-config",
        "node=n2,gpus=5",
        "--replica-config",
        '{"node": "n3", "gpu_idx": [4]}',
        "--engine-arg",
        "--trust-remote-code",
    )
    for needle in (
        "replica 0: unknown node n9",
        "replica 1: node n2 has only 4 GPUs, not 5",
        "replica 2: pins GPU 4, which n3 lacks (GPUs 0-3)",
        "replica 2 pins GPU indexes, which needs --pilot",
        "not allowed for transformers: --trust-remote-code",
    ):
        assert needle in line


def test_gpu_type_the_cluster_lacks(xhpc: Xhpc) -> None:
    line = _refused(xhpc, "--gpu-type", "a100")
    assert "no node in partition 'gpu' has GPUs of type 'a100' (there: untyped)" in line


def test_time_over_max_time_against_live_partitions(dev_cluster: Path) -> None:
    """The partition adapter and the MaxTime rule on live `scontrol` output."""
    client = CliSlurmClient(SlurmConfig(conf_path=dev_cluster))

    async def read() -> tuple[list[NodeInfo], list[PartitionInfo], str | None]:
        return await asyncio.gather(
            client.nodes(), client.partitions(), client.accounting_storage_type()
        )

    nodes, parts, storage = asyncio.run(read())
    assert [(p.name, p.default, p.max_time_min, p.state) for p in parts] == [
        ("gpu", True, 1440, "UP"),
        ("urgent", False, 1440, "UP"),  # its jobs preempt those of `gpu` (chaos tests)
    ]
    assert accounting_enabled(storage)  # slurmdbd (scripts/dev-accounting): account/QOS checked
    config = XhpcConfig(slurm=SlurmConfig(partition="gpu"))

    def check(time: str) -> list[str]:
        req = ServeRequest(model="m", time=time)
        return admission_problems(req, nodes, config, EngineKind.VLLM, parts)

    assert check("1-00:00:00") == []
    assert check("2-00:00:00") == [
        "--time 2-00:00:00 is longer than MaxTime 1-00:00:00 of partition 'gpu'"
    ]


def test_time_over_max_time_is_refused_end_to_end(xhpc: Xhpc) -> None:
    line = _refused(xhpc, "--time", "2-00:00:00")
    assert "longer than MaxTime 1-00:00:00 of partition 'gpu'" in line
