"""Idle-first placement on the real dev cluster (3 nodes x 4 fake GPUs)."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.conftest import XHPC, NodeProbes, Xhpc, slurm_env, wait_for

pytestmark = pytest.mark.cluster


def _placed(x: Xhpc, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The replicas once Slurm has allocated all of them (node and GPU indexes known)."""

    def ready() -> list[dict[str, Any]] | None:
        rows = [r for r in x.json("ps") if r["replica_id"] in ids]
        if len(rows) == len(ids) and all(r["node"] and r["gpus"] for r in rows):
            return rows
        return None

    rows = wait_for(ready, 60, "Slurm to allocate every replica", step_s=0.5)
    assert isinstance(rows, list)
    return rows


def _assert_disjoint(rows: Sequence[dict[str, Any]]) -> None:
    seen: set[tuple[str, int]] = set()
    for r in rows:
        for g in r["gpus"]:
            assert (r["node"], g) not in seen, f"GPU {g} on {r['node']} given twice"
            seen.add((r["node"], g))


def _serve(x: Xhpc, name: str, *args: str) -> list[str]:
    dep = x.json("serve", "tiny-llama", "--name", name, "--engine", "command", "--detach", *args)
    return [r["replica_id"] for r in dep["replicas"]]


def test_six_two_gpu_replicas_spread_with_disjoint_gpus(
    xhpc_placeholder: Xhpc, unique_name: str
) -> None:
    ids = _serve(xhpc_placeholder, unique_name, "--replicas", "6", "--gpus", "2")
    rows = _placed(xhpc_placeholder, ids)
    assert Counter(r["node"] for r in rows) == {"n1": 2, "n2": 2, "n3": 2}
    assert all(len(r["gpus"]) == 2 for r in rows)
    _assert_disjoint(rows)
    xhpc_placeholder.run("stop", unique_name)


@pytest.fixture
def drained_n3(dev_cluster: object) -> Iterator[str]:
    def scontrol(*args: str) -> None:
        subprocess.run(["scontrol", "update", "nodename=n3", *args], env=slurm_env(), check=True)

    scontrol("state=drain", "reason=xhpc-test")
    try:
        yield "n3"
    finally:
        scontrol("state=resume")


def test_a_drained_node_is_avoided(
    drained_n3: str, xhpc_placeholder: Xhpc, unique_name: str
) -> None:
    # The broker places by its view of Slurm (at most `placement.max_view_age_s` old): wait
    # until that view has the drain, then serve.
    def drained_in_view() -> bool:
        nodes = xhpc_placeholder.json("nodes")["nodes"]  # type: ignore[index]
        return any(n["name"] == drained_n3 and not n["usable"] for n in nodes)

    wait_for(drained_in_view, 30, "the broker's view to show n3 drained")
    ids = _serve(xhpc_placeholder, unique_name, "--replicas", "4", "--gpus", "1")
    rows = _placed(xhpc_placeholder, ids)
    assert Counter(r["node"] for r in rows) == {"n1": 2, "n2": 2}
    _assert_disjoint(rows)
    xhpc_placeholder.run("stop", unique_name)


def test_parallel_launches_never_overbook_and_spread(
    xhpc_placeholder: Xhpc, unique_name: str
) -> None:
    x = xhpc_placeholder
    names = [f"{unique_name}-{i}" for i in range(10)]
    procs = [
        subprocess.Popen(
            [XHPC, "serve", "tiny-llama", "--name", n, "--engine", "command", "--detach", "--json"],
            env=x.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in names
    ]
    for p in procs:
        _out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    rows = _placed(x, [f"{n}-0" for n in names])
    per_node = Counter(r["node"] for r in rows)
    assert max(per_node.values()) <= 4
    assert sorted(per_node.values()) == [3, 3, 4], per_node
    _assert_disjoint(rows)
    stops = [
        subprocess.Popen([XHPC, "stop", n], env=x.env, stdout=subprocess.DEVNULL) for n in names
    ]
    assert all(p.wait(120) == 0 for p in stops)


def test_a_node_whose_probe_reports_a_lost_gpu_is_avoided(
    xhpc_placeholder: Xhpc, node_probes: NodeProbes, unique_name: str
) -> None:
    x = xhpc_placeholder
    node_probes.write("n1", "count = 4\n[[gpus]]\nindex = 2\nlost = true\n")

    def n1_unhealthy() -> bool:
        nodes = {n["name"]: n for n in x.json("nodes")["nodes"]}
        return nodes["n1"]["unhealthy"] == 1

    wait_for(n1_unhealthy, 20, "the lost GPU to show in the broker's snapshot")
    assert "UNHEALTHY" in x.run("nodes").stdout
    ids = _serve(x, unique_name, "--replicas", "2", "--gpus", "2")
    rows = _placed(x, ids)
    assert sorted(r["node"] for r in rows) == ["n2", "n3"]
    x.run("stop", unique_name)
