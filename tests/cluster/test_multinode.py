"""Replicas across nodes on the real cluster with real vLLM on CPU: one Slurm job over two nodes,
one agent per node, one engine whose pipeline spans them (vLLM's own multi-node launch).

What a user relies on: its greedy answers are a one-node replica's; a lost node takes it out of
rotation within seconds and a whole replacement serves; a walltime handover costs no request;
another user reads nothing of its rendezvous. No latency is asserted (bench/multinode.py
measures it).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.test_chaos import ready, replicas
from tests.cluster.test_pd import _transferred
from tests.cluster.traffic import Traffic
from tests.conftest import (
    DEV_CLUSTER,
    SYSTEM_PYTHON,
    Xhpc,
    as_uid,
    needs_other_users,
    own_xhpc,
    slurm_env,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

PROMPTS = ("Hello", "The quick brown fox", "One, two, three", "A cluster of nodes")
NOBODY = 65534
# Quick replacement on the dev cluster (the site defaults are minutes).
QUICK = """
[lifecycle]
backoff_s = 1
lost_grace_s = 20
"""
# Weights staged on each node's disk before its rank starts (one directory here: the dev nodes
# share this machine's filesystem, and the ledger records a copy per node).
STAGED = (
    QUICK
    + """
[cache]
local_dir = "@STATE@/local"
"""
)


def _serve(x: Xhpc, name: str, *args: str) -> None:
    x.run(
        "serve", "tiny-llama", "--name", name, "--engine", "vllm", "--timeout", "480", *args,
    )  # fmt: skip


def _answers(x: Xhpc, name: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in PROMPTS:
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
        out.append(reply.choices[0].text)
    return out


def _job_nodes(job_id: str) -> list[str]:
    """The nodes of a running job, or of one hetjob component (``LEADER+OFFSET``)."""
    listing = subprocess.run(
        ["squeue", "-h", "-o", "%i|%N"],
        env=slurm_env(), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out = next((ln.split("|")[1] for ln in listing.splitlines() if ln.split("|")[0] == job_id), "")
    assert out, listing
    expanded = subprocess.run(
        ["scontrol", "show", "hostnames", out],
        env=slurm_env(), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return expanded.split()


@pytest.mark.chaos
def test_a_two_node_replica_answers_as_one_node_does_and_is_replaced_whole_when_a_node_dies(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    """Its greedy answers are a one-node replica's, and another user reads nothing of its
    rendezvous nor calls its engine. Then the node of its rank 1 dies under traffic: the replica
    leaves the routing table within seconds (its head hears nothing from rank 1), and a new
    two-node replica serves the same answers."""
    one, two = f"{unique_name}-a", f"{unique_name}-b"
    with own_xhpc(tiny_model, STAGED) as x:
        _serve(x, one, "--detach")
        _serve(x, two, "--nodes", "2", "--gpus", "1")
        wait_for(lambda: len(ready(x, one)) == 1, 480, "the one-node replica READY")
        (first,) = ready(x, two)
        job = str(first["job_id"])
        nodes = _job_nodes(job)
        assert len(nodes) == 2 and first["node"] == nodes[0], nodes
        rdir = x.state_dir / "replicas" / first["replica_id"]
        script = (rdir / "job.sbatch").read_text()
        assert "#SBATCH --nodes=2" in script and "--kill-on-bad-exit=1" in script
        # one engine: rank 0 serves, rank 1 runs the second pipeline stage on the other node
        rank1 = (rdir / f"engine-{job}-rank1.log").read_text(errors="replace")
        assert "Worker_PP1" in rank1, rank1[-2000:]
        copies = x.json("cache", "ls")
        assert isinstance(copies, list)
        held = {c["node"] for c in copies if c["model"] == "tiny-llama"}
        assert set(nodes) <= held, copies  # the weights were staged on every node of the set
        before = _answers(x, two)
        assert before == _answers(x, one)
        x.run("stop", one)
        if not needs_other_users.args[0]:  # its skipif condition: no other Unix user here
            _another_user_gets_nothing(first, next(rdir.glob("rendezvous-*.json")))

        victim = nodes[1]
        k = victim.removeprefix("n")
        try:
            with Traffic(x.proxy_url, two, done_marker=True, warm_s=240) as load:
                wait_for(lambda: load.ok_since(0) >= 2, 120, "traffic to flow")
                subprocess.run([str(DEV_CLUSTER), "node-fail", k], check=True)
                # Out of rotation long before Slurm calls the node down (tens of seconds).
                wait_for(lambda: not ready(x, two), 15, "the replica out of rotation")

                def replaced() -> bool:
                    rows = ready(x, two)
                    return len(rows) == 1 and rows[0]["replica_id"] != first["replica_id"]

                wait_for(replaced, 480, "a whole replacement READY")
                after = time.monotonic()
                wait_for(lambda: load.ok_since(after) >= 2, 120, "traffic after the replacement")
        finally:
            subprocess.run([str(DEV_CLUSTER), "node-up", k], check=True)
        (lost,) = [r for r in replicas(x, two, all_=True) if r["replica_id"] == first["replica_id"]]
        assert "rank 1 of 2 on " in (lost["reason"] or ""), lost
        assert lost["node"] == victim, lost  # its replacement keeps off that node
        assert victim not in _job_nodes(str(ready(x, two)[0]["job_id"]))
        assert _answers(x, two) == before
        assert load.truncated() == [], load.summary()
        x.run("stop", two)
        x.wait_no_jobs(180)


def _another_user_gets_nothing(row: dict[str, Any], rendezvous: Path) -> None:
    """Another Unix user reads nothing of the rendezvous, and the engine refuses its call."""
    code = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n    open(sys.argv[1]).read(); print('read')\n"
        "except OSError: print('refused')\n"
        "try:\n    urllib.request.urlopen(sys.argv[2] + '/v1/models', timeout=10);"
        " print('answered')\n"
        "except urllib.error.HTTPError as e: print(e.code)\n"
    )
    seen = subprocess.run(
        [*as_uid(NOBODY), SYSTEM_PYTHON, "-c", code, str(rendezvous),
         f"http://{row['host']}:{row['port']}"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert seen.stdout.split() == ["refused", "401"], seen.stdout + seen.stderr


WALLTIME = (
    QUICK
    + """
handover_floor_s = 300
"""
)


@pytest.mark.chaos
def test_a_two_node_replica_hands_over_at_its_walltime_under_traffic(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    """Its job reaches its time limit under steady traffic: a whole two-node successor starts
    before the end and takes the traffic when READY; the first drains; no request fails."""
    name = unique_name
    with own_xhpc(tiny_model, WALLTIME) as x:
        _serve(x, name, "--nodes", "2", "--gpus", "1", "--time", "00:06:00")
        first = {r["replica_id"] for r in ready(x, name)}
        body: dict[str, object] = {"ignore_eos": True}  # exactly max_tokens tokens
        with Traffic(x.proxy_url, name, done_marker=True, extra=body, warm_s=240) as load:

            def handed_over() -> bool:
                rows = replicas(x, name, all_=True)
                new = [r for r in rows if r["replica_id"] not in first and r["state"] == "READY"]
                old = [r for r in rows if r["replica_id"] in first]
                return bool(new) and all(r["state"] in ("STOPPED", "DRAINING") for r in old)

            wait_for(handed_over, 480, "a successor READY and the first replica retired")
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 3, 120, "traffic after the handover")
        assert load.truncated() == [], load.summary()
        assert load.failures() == [], load.summary()
        x.run("stop", name)
        x.wait_no_jobs(180)


# Longer than one 32-token block (the dev cluster's PD block size): its KV is transferred.
LONG = (
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly "
    "and a wizard's job is to vex chumps quickly in fog; pack my box with five dozen liquor "
    "jugs, then sphinx of black quartz, judge my vow. Tell me what happens next:"
)


def _greedy(client: openai.OpenAI, name: str) -> list[str]:
    out = []
    for prompt in (*PROMPTS, LONG):
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        out.append(reply.choices[0].text)
    return out


def _proxy(x: Xhpc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.chaos
def test_a_pd_unit_whose_prefill_spans_two_nodes_keeps_greedy_output_and_is_replaced_whole(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    """A 1P1D unit whose prefill instance is one engine pipelined over two nodes (its
    component of the hetjob: two nodes, an agent on each): the decode instance takes the KV of
    both pipeline stages (NIXL's push mode, which xhpc picks for a pipelined prefill), and the
    unit's greedy answers are its pipelined prefill engine's own, asked alone (and that
    engine's are a one-node replica's: the test above). Then the node of the prefill's rank 1 dies
    under traffic: the unit leaves the routing table within seconds, no answer comes back cut
    short, and once the node is back a whole new unit runs, its components on nodes of their
    own."""
    unit = unique_name
    with own_xhpc(tiny_model, QUICK) as x:
        _serve(x, unit, "--pd", "1P1D", "--prefill-nodes", "2")
        rows = {r["role"]: r for r in ready(x, unit)}
        assert sorted(rows) == ["decode", "prefill"], rows
        prefill, decode = rows["prefill"], rows["decode"]
        job = str(prefill["job_id"])
        assert job.endswith("+0"), job
        nodes = _job_nodes(job)
        assert len(nodes) == 2 and prefill["node"] == nodes[0], nodes
        rdir = x.state_dir / "replicas" / prefill["replica_id"]
        rank1 = (rdir / f"engine-{job}-rank1.log").read_text(errors="replace")
        assert "Worker_PP1" in rank1, rank1[-2000:]
        (secret,) = rdir.glob("engine_secret")  # the test is the replica's owner
        alone = openai.OpenAI(
            base_url=f"http://{prefill['host']}:{prefill['port']}/v1",
            api_key=secret.read_text().strip(),
            max_retries=0,
        )
        before = _greedy(_proxy(x), unit)
        assert before == _greedy(alone, unit)
        assert _transferred(decode) > 0  # the decode took the prompt's KV from the prefill

        victim = nodes[1]
        k = victim.removeprefix("n")
        try:
            with Traffic(x.proxy_url, unit, done_marker=True, warm_s=240) as load:
                wait_for(lambda: load.ok_since(0) >= 2, 120, "traffic to flow")
                killed = time.monotonic()
                subprocess.run([str(DEV_CLUSTER), "node-fail", k], check=True)
                wait_for(lambda: len(ready(x, unit)) < 2, 15, "the unit out of rotation")
                # The node reboots: the whole new unit needs all three nodes (Slurm gives each
                # instance of a hetjob nodes of its own), so it starts once the node is back.
                subprocess.run([str(DEV_CLUSTER), "node-up", k], check=True)

                old = {prefill["replica_id"], decode["replica_id"]}

                def replacing() -> list[dict[str, Any]]:
                    rows = replicas(x, unit, all_=True)
                    new = [r for r in rows if r["replica_id"] not in old]
                    running = len(new) == 2 and all(
                        r["state"] in ("STARTING", "READY") for r in new
                    )
                    return new if running else []

                # A whole new unit runs (its engines starting): that it then serves is the
                # single-node units' test (tests/cluster/test_pd.py), cheaper to wait for.
                new = {r["role"]: r for r in wait_for(replacing, 300, "a whole new unit running")}
        finally:
            subprocess.run([str(DEV_CLUSTER), "node-up", k], check=True)
        (lost,) = [
            r for r in replicas(x, unit, all_=True) if r["replica_id"] == prefill["replica_id"]
        ]
        assert "rank 1 of 2 on " in (lost["reason"] or ""), lost
        assert lost["node"] == victim, lost
        spread = _job_nodes(str(new["prefill"]["job_id"])) + _job_nodes(
            str(new["decode"]["job_id"])
        )
        assert len(set(spread)) == 3, spread  # a component per instance, nodes of its own
        # A request the unit had in flight when the prefill's node died may fail (told: an
        # error status or an error event), never come back as a 200 without its answer (vLLM
        # answers a request it aborted so: the PD route does not pass that on).
        assert load.truncated() == [], load.summary()
        failed = [o for o in load.failures() if o.status != 503]
        assert all(abs(o.at - killed) < 10 for o in failed), load.summary()
        x.run("stop", unit)
        x.wait_no_jobs(180)
