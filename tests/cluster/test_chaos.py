"""The chaos suite: a model outlives its jobs on the real cluster, under steady traffic.

Every test serves the tiny model with a real engine (`transformers serve`), runs traffic through
the proxy with every answer checked (tests/cluster/traffic.py), injects one fault of a cluster's
ordinary life and checks what users and operators see: no failed request where none may fail,
never a truncated 200, the deployment back at full strength, no extra or leaked jobs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_pilot import ECHO
from tests.cluster.traffic import Traffic
from tests.conftest import (
    DEV_CLUSTER,
    PLACEHOLDER_ENGINE,
    XHPC,
    Xhpc,
    _start_xhpc,
    _teardown_xhpc,
    own_xhpc,
    slurm_env,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.engine, pytest.mark.chaos]

# Quick replacement on the dev cluster (the site defaults are minutes).
CHAOS_CONFIG = """
[lifecycle]
backoff_s = 1
lost_grace_s = 20
"""


@pytest.fixture
def chaos(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    with own_xhpc(tiny_model, CHAOS_CONFIG) as x:
        yield x


def replicas(x: Xhpc, name: str, *, all_: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(
        x.run("ps", "--json", *(["--all"] if all_ else [])).stdout
    )
    return [r for r in rows if r["deployment"] == name]


def ready(x: Xhpc, name: str) -> list[dict[str, Any]]:
    return [r for r in replicas(x, name) if r["state"] == "READY"]


def serve(x: Xhpc, name: str, *args: str) -> list[dict[str, Any]]:
    dep = json.loads(
        x.run(
            "serve", "tiny-llama", "--name", name, "--engine", "transformers", "--timeout", "180",
            "--json", *args,
        ).stdout
    )  # fmt: skip
    rows: list[dict[str, Any]] = dep["replicas"]
    assert all(r["state"] == "READY" for r in rows)
    return rows


def engine_pid(replica_id: str, job_id: str, what: bytes = b"serve") -> int:
    """The engine process of one replica's job (its working directory is the agent's private
    scratch, ``xhpc-REPLICA-JOB-RANDOM``)."""
    mark = f"xhpc-{replica_id}-{job_id}"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if Path(cwd).name.startswith(f"{mark}-") and what in cmd:  # its private scratch
            return int(proc.name)
    raise AssertionError(f"no engine process for {replica_id} (job {job_id})")


def only_in_flight(load: Traffic, fault_at: float) -> None:
    """Every failure was a request already on its way to the replica hit at ``fault_at``, and
    it failed as an error (5xx, or a stream's error event), never as a truncated 200."""
    told = f"{load.summary()}; the fault at {load.since_start(fault_at)}"
    assert load.truncated() == [], told
    failed = load.failures()
    assert len(failed) <= load.workers, told
    assert all(o.at < fault_at + 1 for o in failed), told
    assert all(o.status in (200, 502) for o in failed), told  # 200: an error event


def only_begun_streams(load: Traffic, fault_at: float) -> None:
    """A lost node (its job gone whole, agent and all) costs only streams whose client already
    had bytes (they end with an error event): a request without a byte of its answer goes to
    another replica, since the request cannot be what killed a whole job."""
    only_in_flight(load, fault_at)
    told = f"{load.summary()}; the fault at {load.since_start(fault_at)}"
    assert all(o.stream and o.status == 200 for o in load.failures()), told


def events(x: Xhpc, name: str) -> str:
    return x.run("logs", name, check=False).stdout


def broker_log(x: Xhpc) -> str:
    return (x.state_dir / "broker.log").read_text(errors="replace")


def test_an_engine_killed_under_load_is_replaced(chaos: Xhpc, unique_name: str) -> None:
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    with Traffic(x.proxy_url, name) as load:
        wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
        victim = first[0]
        killed_at = time.monotonic()
        os.kill(engine_pid(victim["replica_id"], str(victim["job_id"])), signal.SIGKILL)

        def replaced() -> bool:
            rows = ready(x, name)
            return len(rows) == 2 and victim["replica_id"] not in {r["replica_id"] for r in rows}

        wait_for(replaced, 120, "a replacement READY in the killed replica's place")
        after = time.monotonic()
        wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic on the replacement")
    # Requests in flight on the dead engine fail with an error (a request during which an
    # engine died is never tried on the next replica: it may be what killed it); requests sent
    # after it are routed elsewhere. Nothing ends as a truncated 200.
    only_in_flight(load, killed_at)
    assert "action=replace" in broker_log(x)
    x.run("stop", name)


def test_requeue_takes_the_replica_out_of_rotation_until_its_job_runs_again(
    chaos: Xhpc, unique_name: str
) -> None:
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    victim = first[0]
    job = str(victim["job_id"])
    with Traffic(x.proxy_url, name) as load:
        wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
        subprocess.run(["scontrol", "requeue", job], env=slurm_env(), check=True)
        wait_for(
            lambda: (
                {r["replica_id"]: r["state"] for r in replicas(x, name)}.get(victim["replica_id"])
                == "QUEUED"
            ),
            20,
            "the requeued replica to leave READY",
        )
        # The same job runs again (Slurm restarts it) and the same replica serves again.
        wait_for(
            lambda: victim["replica_id"] in {r["replica_id"] for r in ready(x, name)},
            120,
            "the requeued replica READY again",
        )
        after = time.monotonic()
        wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the requeue")
    assert {r["job_id"] for r in replicas(x, name)} == {r["job_id"] for r in first}, "no new job"
    assert load.failures(stream=False) == [], load.summary()
    assert load.truncated() == [], load.summary()
    x.run("stop", name)


def test_broker_killed_and_down_loses_no_route_and_relaunches_nothing(
    chaos: Xhpc, unique_name: str
) -> None:
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    broker = x.procs[0]
    with Traffic(x.proxy_url, name) as load:
        wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        down = time.monotonic()
        # Down longer than the heartbeat timeout: saved heartbeats are stale at the restart.
        wait_for(lambda: load.ok_since(down) >= 40 and time.monotonic() - down > 25, 120, "25 s")
        x.procs.remove(broker)
        x.start("broker")
        wait_for(lambda: x.run("ps", check=False).returncode == 0, 30, "the broker back")
        back = time.monotonic()
        # Past the restart grace, nothing went LOST and nothing was resubmitted.
        wait_for(lambda: time.monotonic() - back > 20 and load.ok_since(back) >= 20, 90, "20 s")
        rows = replicas(x, name)
    assert [r["state"] for r in rows] == ["READY", "READY"], rows
    assert {r["job_id"] for r in rows} == {r["job_id"] for r in first}
    assert load.failures() == [], load.summary()
    assert "to=LOST" not in broker_log(x)
    x.run("stop", name)


def test_a_second_broker_on_the_same_state_exits_and_leaves_the_first_alone(
    chaos: Xhpc, unique_name: str
) -> None:
    x = chaos
    proc = subprocess.run(
        [XHPC, "broker"],
        env=x.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0
    assert "another broker already runs" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert x.run("ps", check=False).returncode == 0  # the first broker's socket still answers


@pytest.mark.parametrize("fault", ["node-fail", "link-down"])
def test_a_lost_node_is_left_and_its_replica_moves(
    chaos: Xhpc, unique_name: str, fault: str
) -> None:
    """The node dies (its slurmd and processes are killed: connections are reset) or its link
    goes down (nothing is reset: connections fall silent). Requests without a byte of their
    answer go to the other replica either way; the replica moves to another node."""
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    victim = first[0]
    node = str(victim["node"])
    k = node.removeprefix("n")
    back = "node-up" if fault == "node-fail" else "link-up"
    try:
        # Four workers: requests are in flight on the node when it fails.
        with Traffic(x.proxy_url, name, workers=4) as load:
            wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
            failed_at = time.monotonic()
            subprocess.run([str(DEV_CLUSTER), fault, k], check=True)

            def moved() -> bool:
                rows = ready(x, name)
                return len(rows) == 2 and node not in {r["node"] for r in rows}

            wait_for(moved, 240, "the lost node's replica READY on another node")
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the move")
    finally:
        subprocess.run([str(DEV_CLUSTER), back, k], check=True)
    only_begun_streams(load, failed_at)
    # The broker moved it itself when the agent did not answer, before Slurm noticed the node.
    assert f"lost on {node}: its agent does not answer; re-planned to" in broker_log(x)
    x.run("stop", name)
    # The lost node's job ends when Slurm has heard from the node again (it may have come back
    # before Slurm even saw it go): its slurmd re-registers, the job is found gone and ends.
    x.wait_no_jobs(180)
    if fault == "link-down":  # the node serves again for the tests after this one
        wait_for(lambda: node_state(node) in ("idle", "mixed"), 120, f"{node} back in service")


def node_state(node: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-n", node, "-o", "%T"], env=slurm_env(), capture_output=True, text=True
    ).stdout
    return out.strip().splitlines()[0].rstrip("*~#") if out.strip() else ""


def test_preemption_requeues_and_the_replica_serves_again(chaos: Xhpc, unique_name: str) -> None:
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    victim = first[0]
    node = str(victim["node"])
    script = x.state_dir / "urgent.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --partition=urgent\n#SBATCH --gres=gpu:4\n"
        f"#SBATCH --nodelist={node}\n#SBATCH --time=5\n#SBATCH --output=/dev/null\nsleep 600\n"
    )
    urgent = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=slurm_env(), check=True,
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    try:
        with Traffic(x.proxy_url, name) as load:
            wait_for(lambda: load.ok_since(0) >= 5, 60, "traffic to flow")

            def served_elsewhere() -> bool:
                rows = ready(x, name)
                return len(rows) == 2 and node not in {r["node"] for r in rows}

            wait_for(served_elsewhere, 180, "the preempted replica READY on another node")
            after = time.monotonic()
            wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the preemption")
    finally:
        subprocess.run(["scancel", urgent], env=slurm_env(), check=False)
    assert load.failures(stream=False) == [], load.summary()
    assert load.truncated() == [], load.summary()
    x.run("stop", name)


# Two handovers in about two minutes: 3-minute jobs, successors 2 minutes before each end (the
# time limit's warning comes 1 minute before it).
WALLTIME_CONFIG = """
[lifecycle]
handover_floor_s = 120
"""


@pytest.fixture
def walltime(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    with own_xhpc(tiny_model, WALLTIME_CONFIG) as x:
        yield x


def test_replicas_and_pilots_hand_over_at_their_walltimes_at_no_request(
    walltime: Xhpc, unique_name: str
) -> None:
    """Side by side (the waits are the time limits', so they overlap): a replica in its own job
    crosses two walltime boundaries, and a replica in a pilot hands over into a new pilot; no
    request of the traffic to either fails."""
    x = walltime
    plain, piloted = f"{unique_name}-job", f"{unique_name}-pilot"
    (first,) = serve(x, plain, "--time", "00:03:00")
    (in_pilot,) = serve(x, piloted, "--time", "00:03:00", "--pilot", "n1", "--pilot-gpus", "1")
    first_pilot = in_pilot["job_id"]
    seen: set[str] = {first["replica_id"]}
    with Traffic(x.proxy_url, plain) as load, Traffic(x.proxy_url, piloted) as pilot_load:

        def handed_over_twice() -> bool:
            rows = ready(x, plain)
            seen.update(r["replica_id"] for r in rows)
            return (
                len(seen) >= 3 and len(rows) >= 1 and rows[-1]["replica_id"] != first["replica_id"]
            )

        def pilot_handed_over() -> bool:
            rows = ready(x, piloted)
            return len(rows) == 1 and rows[0]["job_id"] != first_pilot

        def old_pilot_gone() -> bool:
            pilots = json.loads(x.run("ps", "--pilots", "--json").stdout)
            return first_pilot not in {p["job_id"] for p in pilots if p["state"] == "RUNNING"}

        wait_for(pilot_handed_over, 240, "a successor READY in a new pilot")
        wait_for(handed_over_twice, 300, "two walltime handovers")
        after = time.monotonic()
        wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the handovers")
        wait_for(lambda: pilot_load.ok_since(after) >= 10, 60, "traffic to the new pilot")
        wait_for(old_pilot_gone, 90, "the retired pilot to end (its replica drained)")
    every = replicas(x, plain, all_=True)
    log = broker_log(x)
    assert log.count("action=successor") >= 3, log[-2000:]
    # Predecessors were drained and stopped (not failed); one job per replica, none extra.
    retired = [r for r in every if r["replica_id"] != every[-1]["replica_id"]]
    assert all(r["state"] in ("STOPPED", "DRAINING") for r in retired[:2]), every
    assert load.failures() == [], load.summary()
    assert pilot_load.failures() == [], pilot_load.summary()
    assert load.sent() > 50
    x.run("stop", plain)
    x.run("stop", piloted)
    wait_for(lambda: not x.my_jobs(), 60, "no job left")


def test_a_requeued_pilot_takes_its_replica_out_of_rotation_until_it_runs_again(
    chaos: Xhpc, unique_name: str
) -> None:
    x, name = chaos, unique_name
    (first,) = serve(x, name, "--pilot", "n2", "--pilot-gpus", "1")
    pilot_job = str(first["job_id"])
    with Traffic(x.proxy_url, name) as load:
        wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
        requeued_at = time.monotonic()
        subprocess.run(["scontrol", "requeue", pilot_job], env=slurm_env(), check=True)
        wait_for(
            lambda: [r["state"] for r in replicas(x, name)] == ["QUEUED"],
            20,
            "the pilot's replica to leave READY",
        )
        wait_for(lambda: ready(x, name), 180, "the replica READY again in the pilot's next run")
        after = time.monotonic()
        wait_for(lambda: load.ok_since(after) >= 10, 60, "traffic after the requeue")
    (again,) = ready(x, name)
    assert (again["replica_id"], str(again["job_id"])) == (first["replica_id"], pilot_job)
    # While nothing was READY the model answered 503 (never 404); a request the engine had when
    # the requeue stopped it is a 502 (never resent: decision 0015); nothing ended as a cut 200.
    failed = load.failures()
    assert {o.status for o in failed} <= {502, 503}, load.summary()
    in_flight = [o for o in failed if o.status == 502]
    assert len(in_flight) <= load.workers, load.summary()
    assert all(o.at < requeued_at + 1 for o in in_flight), load.summary()
    assert load.truncated() == [], load.summary()
    x.run("stop", name)


def test_a_crash_loop_ends_in_a_clear_failure(chaos: Xhpc, unique_name: str) -> None:
    x, name = chaos, unique_name
    marker = x.state_dir / "crash-now"
    x.env["XHPC_USER_CONFIG"] = str(x.state_dir / "user.toml")
    (x.state_dir / "user.toml").write_text(
        CHAOS_CONFIG
        + f"""
[engines.command]
command = ["{sys.executable}", "{ECHO}", "--port", "{{port}}",
           "--served-model", "{{served_model}}", "--crash-if", "{marker}"]
startup_timeout_s = 60
"""
    )
    # The broker reads its config at start: restart it with the crashing engine's.
    broker = x.procs[0]
    broker.send_signal(signal.SIGTERM)
    broker.wait(20)
    x.procs.remove(broker)
    x.start("broker")
    wait_for(lambda: x.run("ps", check=False).returncode == 0, 30, "the broker back")
    dep = json.loads(
        x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90",
              "--json").stdout
    )  # fmt: skip
    (first,) = dep["replicas"]
    marker.write_text("")
    os.kill(engine_pid(first["replica_id"], str(first["job_id"]), b"echo_engine"), signal.SIGKILL)

    def failed() -> str:
        out = x.run("ps", check=False).stdout
        return out if f"{name}: FAILED: crash loop" in out else ""

    shown = str(wait_for(failed, 120, "the deployment to fail as a crash loop"))
    assert "crashing on start" in shown  # the engine log's last lines, in `xhpc ps`
    every = replicas(x, name, all_=True)
    assert 2 <= len(every) <= 4 and all(r["state"] in ("FAILED", "STOPPED") for r in every)
    wait_for(lambda: not x.my_jobs(), 60, "no job left")
    # The model is gone for the proxy (404), nothing is relaunched.
    assert len(replicas(x, name, all_=True)) == len(every)


def test_slurmctld_down_a_minute_changes_nothing(chaos: Xhpc, unique_name: str) -> None:
    x, name = chaos, unique_name
    first = serve(x, name, "--replicas", "2")
    try:
        with Traffic(x.proxy_url, name) as load:
            wait_for(lambda: load.ok_since(0) >= 10, 60, "traffic to flow")
            before = broker_log(x).count("transition ")
            subprocess.run([str(DEV_CLUSTER), "ctld-stop"], check=True)
            down = time.monotonic()
            wait_for(lambda: time.monotonic() - down >= 60, 90, "60 s without slurmctld", 1.0)
            subprocess.run([str(DEV_CLUSTER), "ctld-start"], check=True)
            up = time.monotonic()
            wait_for(lambda: load.ok_since(up) >= 20, 60, "traffic after slurmctld is back")
    finally:
        subprocess.run([str(DEV_CLUSTER), "ctld-start"], check=True)
    rows = replicas(x, name)
    assert [r["state"] for r in rows] == ["READY", "READY"], rows
    assert {r["job_id"] for r in rows} == {r["job_id"] for r in first}
    assert broker_log(x).count("transition ") == before, "a state changed falsely"
    assert load.failures() == [], load.summary()
    x.run("stop", name)


def _answers(sock_path: Path) -> bool:
    """The broker's control socket accepts connections (a stale socket file refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def _tagged_jobs(broker_id: str) -> dict[str, str]:
    """Jobs of this broker in squeue: job id -> the replica its tag names."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%k|%T"], env=slurm_env(), check=True,
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    jobs: dict[str, str] = {}
    for line in out.splitlines():
        job, comment, _state = line.split("|", 2)
        parts = comment.split(":")
        if len(parts) == 4 and parts[0] == "xhpc" and parts[1] == broker_id:
            jobs[job] = parts[3]
    return jobs


def test_fifty_broker_kills_amid_serve_scale_stop_leave_state_whole(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    x = _start_xhpc(tiny_model, PLACEHOLDER_ENGINE)
    stop = threading.Event()
    rnd = random.Random(unique_name)
    try:

        def churn() -> None:  # serve / scale / stop loops, whatever the broker's fate
            i = 0
            while not stop.is_set():
                name = f"{unique_name}{i % 3}"
                i += 1
                for args in (
                    ("serve", "tiny-llama", "--name", name, "--engine", "command", "--detach"),
                    ("scale", name, "2", "--detach"),
                    ("scale", name, "1", "--detach"),
                    ("stop", name, "--no-wait"),
                ):
                    if stop.is_set():
                        return
                    x.run(*args, check=False, timeout=60)

        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        for _ in range(50):
            broker = x.procs[0]
            wait_for(lambda: _answers(x.state_dir / "broker.sock"), 30, "the broker up", 0.05)
            time.sleep(rnd.uniform(0.05, 1.0))  # a random point in the loops
            broker.send_signal(signal.SIGKILL)
            broker.wait(10)
            x.procs.remove(broker)
            x.procs.insert(0, x.start("broker"))
            x.procs.pop()  # (start() appended it too)
        stop.set()
        worker.join(120)
        wait_for(lambda: x.run("ps", check=False).returncode == 0, 30, "the broker up")
        broker_id = (x.state_dir / "broker-id").read_text().strip()
        db = x.state_dir / "xhpc.db"

        def whole() -> bool:
            """Every job of this broker has exactly one live row; every live row its job."""
            rows = json.loads(x.run("ps", "--all", "--json").stdout)
            live = [r for r in rows if r["state"] not in ("STOPPED", "FAILED")]
            jobs = _tagged_jobs(broker_id)
            by_job: dict[str, list[str]] = {}
            for r in live:
                if r["job_id"]:
                    by_job.setdefault(str(r["job_id"]), []).append(r["replica_id"])
            ok_jobs = all(by_job.get(j) == [rid] for j, rid in jobs.items())
            ok_rows = all(str(r["job_id"]) in jobs for r in live if r["job_id"])
            return ok_jobs and ok_rows and all(r["job_id"] for r in live)

        # The sweep judges rows 30 s after their last change, every 15 s.
        wait_for(whole, 120, "every job with one live row and every live row with its job", 1.0)
        check = sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()
        assert check == ("ok",)
        for i in range(3):
            x.run("stop", f"{unique_name}{i}", check=False)
        wait_for(lambda: not _tagged_jobs(broker_id), 120, "no job of this broker left")
    finally:
        stop.set()
        _teardown_xhpc(x)
