"""Replicas across nodes, the pure parts: each rank's engine command, the rendezvous and the
ranks' heartbeats, the job script, the parallel sizes and admission."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from xhpc.agent.engines import CPU_PIPELINE_COMPILATION, Rank, engine_launch
from xhpc.agent.ranks import (
    alive_file,
    head_rank,
    member_rank,
    node_rank,
    rank_node,
    rendezvous_file,
    silence_s,
    silent_ranks,
    touch_alive,
)
from xhpc.broker.admit.admission import admission_problems
from xhpc.broker.outlook import _node_set
from xhpc.catalog import expand_request
from xhpc.errors import EngineError
from xhpc.models import AgentSpec, EngineKind, JobInfo, NodeInfo, ReplicaOutlook, ServeRequest
from xhpc.placement.layout import parallel_sizes, span_engine_args, span_problems
from xhpc.render import SbatchParams, render_sbatch, shape_options
from xhpc.settings import XhpcConfig


def spec(**kw: Any) -> AgentSpec:
    fields: dict[str, Any] = {
        "replica_id": "m-0",
        "deployment": "m",
        "engine": EngineKind.VLLM,
        "model_path": "/models/m",
        "served_model": "m",
        "broker_file": "/state/broker.json",
        "nodes": 2,
        "execute_timeout_s": 60.0,
        "args": ("--enforce-eager", "--dtype", "float32"),
        **kw,
    }
    return AgentSpec(**fields)


def launch(s: AgentSpec, rank: Rank, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    out = engine_launch(
        s,
        host="0.0.0.0",
        port=8123,
        node_address="10.77.0.12",
        tmp_dir=tmp_path,
        job_env={"PATH": "/usr/bin"},
        api_key="s3cret",
        rank=rank,
    )
    return list(out.argv), out.env


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- each rank's engine ---------------------------------------------------------------------------
def test_rank_0_serves_the_api_and_the_others_run_headless(tmp_path: Path) -> None:
    head = Rank(rank=0, nodes=2, master_addr="10.77.0.11", master_port=29501, interface="eth0")
    argv, env = launch(spec(), head, tmp_path)
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert argv[4] == "/models/m"
    assert flag(argv, "--distributed-executor-backend") == "mp"
    assert (flag(argv, "--nnodes"), flag(argv, "--node-rank")) == ("2", "0")
    assert (flag(argv, "--master-addr"), flag(argv, "--master-port")) == ("10.77.0.11", "29501")
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("0.0.0.0", "8123")
    assert "--headless" not in argv
    assert env["VLLM_HOST_IP"] == "10.77.0.12"
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "60"
    assert env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(argv)

    member = head.model_copy(update={"rank": 1})
    argv, _ = launch(spec(), member, tmp_path)
    assert flag(argv, "--node-rank") == "1" and "--headless" in argv
    assert "--host" not in argv and "--port" not in argv


def test_on_cpu_the_eager_flag_becomes_the_eager_compilation_backend(tmp_path: Path) -> None:
    rank = Rank(rank=0, nodes=2, master_addr="a", master_port=1)
    argv, _ = launch(spec(cpu_only=True), rank, tmp_path)
    assert "--enforce-eager" not in argv
    assert flag(argv, "--compilation-config") == CPU_PIPELINE_COMPILATION
    assert json.loads(CPU_PIPELINE_COMPILATION) == {"mode": 2, "backend": "eager"}
    argv, _ = launch(spec(cpu_only=False), rank, tmp_path)  # GPUs: the site's flags as they are
    assert "--enforce-eager" in argv and "--compilation-config" not in argv


# -- rendezvous and heartbeats --------------------------------------------------------------------
def test_the_rank_is_the_node_index_of_the_step() -> None:
    assert node_rank({"SLURM_NODEID": "1"}) == 1
    assert node_rank({}) == 0
    assert node_rank({"SLURM_NODEID": "x"}) == 0


def test_members_meet_the_head_where_it_wrote_its_store(tmp_path: Path) -> None:
    path = rendezvous_file(tmp_path, "42", 0)
    assert path != rendezvous_file(tmp_path, "42", 1)  # a requeued run never reads the last's

    async def meet() -> Rank:
        stop = asyncio.Event()
        waiting = asyncio.create_task(member_rank(1, 2, "127.0.0.1", path, 10, stop))
        await asyncio.sleep(0.3)  # the member waits for the head
        head = head_rank(2, "127.0.0.1", path)
        member = await waiting
        assert (member.master_addr, member.master_port) == (head.master_addr, head.master_port)
        return member

    member = asyncio.run(meet())
    assert member.rank == 1 and member.interface == "lo"
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_member_gives_up_when_no_head_tells_it_where_to_meet(tmp_path: Path) -> None:
    path = rendezvous_file(tmp_path, "42", 0)
    with pytest.raises(EngineError, match="no rendezvous"):
        asyncio.run(member_rank(1, 2, "127.0.0.1", path, 0.3, asyncio.Event()))


def test_a_silent_rank_is_found_by_the_age_of_its_heartbeat(tmp_path: Path) -> None:
    path = rendezvous_file(tmp_path, "42", 0)
    now = time.time()
    limit = silence_s(1.0)
    assert limit == 3.0 and silence_s(4.0) == 10.0
    # No rank has shown itself yet: counted from the head's start.
    assert silent_ranks(path, 3, now, limit) == []
    assert silent_ranks(path, 3, now - 10, limit) == [1, 2]
    touch_alive(alive_file(path, 1), "n2")
    assert rank_node(path, 1) == "n2" and rank_node(path, 2) is None
    assert silent_ranks(path, 3, now - 10, limit) == [2]
    old = now - 20
    os.utime(alive_file(path, 1), (old, old))
    assert silent_ranks(path, 3, now - 30, limit) == [1, 2]


# -- the job --------------------------------------------------------------------------------------
def params(**kw: Any) -> SbatchParams:
    fields: dict[str, Any] = {
        "replica_id": "m-0",
        "deployment": "m",
        "job_name": "xhpc-m-0",
        "comment": "xhpc:b:m:m-0",
        "gpus": 4,
        "time": "01:00:00",
        "output": "/state/replicas/m-0/slurm-%j.out",
        "agent_python": "/venv/bin/python",
        "replica_dir": "/state/replicas/m-0",
        **kw,
    }
    return SbatchParams(**fields)


def test_one_job_over_the_nodes_one_agent_per_node_ended_whole() -> None:
    script = render_sbatch(params(nodes=2, exclusive=True, nodelist="n1,n2"))
    lines = script.splitlines()
    assert "#SBATCH --nodes=2" in lines
    assert "#SBATCH --ntasks-per-node=1" in lines and "#SBATCH --ntasks=1" not in lines
    assert "#SBATCH --exclusive" in lines
    assert "#SBATCH --gres=gpu:4" in lines  # on each node
    step = [ln for ln in lines if ln.startswith("srun ")]
    assert len(step) == 1 and "--kill-on-bad-exit=1" in step[0]
    assert step[0].endswith("-I -m xhpc.agent /state/replicas/m-0 &")
    assert any(ln.startswith("trap 'kill -USR1") for ln in lines)
    assert shape_options(params(nodes=2, exclusive=True))[:3] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--exclusive",
    ]
    one = render_sbatch(params()).splitlines()
    assert "#SBATCH --nodes=1" in one and "#SBATCH --exclusive" not in one
    assert not any(ln.startswith("srun ") for ln in one)


# -- parallel sizes and admission -----------------------------------------------------------------
def test_parallel_sizes_as_vllm_reads_them() -> None:
    assert parallel_sizes(["-tp", "4", "--pipeline-parallel-size=2"]) == {"tp": 4, "pp": 2}
    assert parallel_sizes(["--tensor_parallel_size=8"]) == {"tp": 8}
    assert parallel_sizes(["--dtype", "float32", "-pp"]) == {}
    # none given: tensor parallel within a node, the pipeline across the nodes
    assert span_engine_args(2, 4, ["--dtype=float32"])[-2:] == (
        "--tensor-parallel-size=4",
        "--pipeline-parallel-size=2",
    )
    assert span_engine_args(2, 4, ["-tp", "8"]) == ("-tp", "8")
    assert span_engine_args(1, 4, ()) == ()


def node(name: str, gpus: int = 4, state: str = "IDLE") -> NodeInfo:
    return NodeInfo(name=name, address=name, state=state, partitions=("gpu",), gpus_total=gpus)


POOL = [node("n1"), node("n2"), node("n3", state="DOWN"), node("n4", gpus=2)]


def test_span_problems_name_the_sizes_and_the_nodes() -> None:
    assert span_problems(2, 4, ["-tp", "4", "-pp", "2"], POOL, None) == []
    (bad,) = span_problems(2, 4, ["-tp", "4"], POOL, None)
    assert "4 x 1 = 4 is not the 2 x 4 = 8 GPUs" in bad
    (few,) = span_problems(3, 4, [], POOL, None)
    assert "needs 3 usable nodes with 4 GPU(s) each: the partition has 2" in few


def config(**multi: Any) -> XhpcConfig:
    return XhpcConfig.model_validate({"multi_node": multi, "slurm": {"partition": "gpu"}})


def test_admission_refuses_across_nodes_unless_the_site_allows_it() -> None:
    req = ServeRequest(model="m", nodes=2, gpus=4)
    off = admission_problems(req, POOL, config(), EngineKind.VLLM)
    assert any("[multi_node] enabled = false" in p for p in off), off
    assert admission_problems(req, POOL, config(enabled=True), EngineKind.VLLM) == []
    mixed = ServeRequest(model="m", nodes=2, gpus=4, nodelist="n1", pd="1P1D")
    found = admission_problems(mixed, POOL, config(enabled=True), EngineKind.TRANSFORMERS)
    assert any("only the vllm engine spans nodes" in p for p in found), found
    assert any("cannot be combined with --nodelist" in p for p in found), found


def test_the_catalog_layout_becomes_the_request_s_nodes_gpus_and_sizes() -> None:
    cfg = XhpcConfig.model_validate(
        {"models": {"big": {"path": "/w/big", "layouts": {"any": {"tp": 4, "pp": 2}}}}}
    )
    req, _ = expand_request(ServeRequest(model="big"), cfg, {}, gpus_given=False)
    assert (req.nodes, req.gpus) == (2, 4)
    assert parallel_sizes(req.engine_args) == {"tp": 4, "pp": 2}
    mine, _ = expand_request(ServeRequest(model="big", gpus=1), cfg, {}, gpus_given=True)
    assert (mine.nodes, mine.gpus, mine.engine_args) == (1, 1, ())


def test_ps_serve_and_top_show_the_node_set_of_a_running_job() -> None:
    def job(nodes: str, state: str = "RUNNING") -> JobInfo:
        return JobInfo(job_id="7", raw_job_id=7, name="xhpc-m-0", state=state, nodes=nodes)

    assert _node_set(job("n[1-2]")) == "n[1-2]"
    assert _node_set(job("n1,n3")) == "n1,n3"
    assert _node_set(job("n1")) is None
    assert _node_set(job("n[1-2]", "PENDING")) is None
    assert _node_set(None) is None
    out = ReplicaOutlook(replica_id="m-0", node_set="n[1-2]")
    assert out.node_shown("n1") == "n[1-2]"
    assert ReplicaOutlook(replica_id="m-0").node_shown("n1") == "n1"
    assert ReplicaOutlook(replica_id="m-0").node_shown(None) == "-"
