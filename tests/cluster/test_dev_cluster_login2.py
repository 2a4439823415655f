"""The dev cluster's second login node and its PostgreSQL server (scripts/dev-cluster,
scripts/dev-postgres): `scripts/dev-cluster login2 CMD` runs CMD in the network namespace
xhpc-lg2 (10.77.0.2 on the cluster's bridge, hostname login2), from where Slurm's controller
and the site's database answer; `login2-fail` kills everything there and takes its link down,
`login2-up` brings the link back.

These tests fail on a cluster brought up before login node 2 existed
(`scripts/dev-cluster down && scripts/dev-cluster up` makes a new one). `login2-fail` kills
every process on login node 2: nothing else may run there meanwhile.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEV_CLUSTER, free_port, slurm_env, wait_for
from tests.postgres import pg_bin

pytestmark = pytest.mark.cluster

NAMESPACE, VETH, ADDRESS = "xhpc-lg2", "xhpclg2", "10.77.0.2"  # scripts/dev-cluster's login node 2


def _dev(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """scripts/dev-cluster ARGS, with the test's environment and the cluster's SLURM_CONF."""
    return subprocess.run(
        [str(DEV_CLUSTER), *args], env=slurm_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _login2(*argv: str) -> subprocess.CompletedProcess[str]:
    return _dev("login2", *argv)


@pytest.fixture
def login2(dev_cluster: Path) -> Iterator[None]:
    """Login node 2, up; its link up again at the end whatever the test did to it."""
    assert Path("/run/netns", NAMESPACE).exists(), (
        f"no namespace {NAMESPACE}: this dev cluster predates login node 2 (down, then up)"
    )
    try:
        yield
    finally:
        _dev("login2-up")


def _link_up() -> bool:
    out = subprocess.run(
        ["ip", "-o", "link", "show", VETH], check=True, capture_output=True, text=True
    ).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",")
    return "UP" in flags


def _pids_inside() -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", NAMESPACE], capture_output=True, text=True).stdout
    return {int(p) for p in out.split() if p.isdigit()}


def test_login2_is_a_login_node_of_the_cluster(login2: None) -> None:
    done = _login2("hostname")
    assert (done.returncode, done.stdout.strip()) == (0, "login2"), done.stderr
    done = _login2("ip", "-o", "-4", "addr", "show", "dev", "eth0")
    assert f"inet {ADDRESS}/24" in done.stdout, done.stdout + done.stderr
    # slurmctld (10.77.0.1) answers over the bridge: a node count per partition.
    done = _login2("sinfo", "-h", "-o", "%D")
    assert done.returncode == 0, done.stderr
    counts = done.stdout.split()
    assert counts and all(c.isdigit() and int(c) > 0 for c in counts), done.stdout
    # The command's exit status comes back; the caller's environment goes in.
    assert _login2("sh", "-c", "exit 7").returncode == 7
    done = _login2("sh", "-c", 'echo "$SLURM_CONF"')
    assert done.stdout.strip() == slurm_env()["SLURM_CONF"]


def test_login2_reaches_the_site_postgres(login2: None) -> None:
    bin_dir = pg_bin()
    psql = str(bin_dir / "psql") if bin_dir else shutil.which("psql")
    assert psql, "no psql (Debian package postgresql)"
    url = _dev("db-url").stdout.strip()
    assert url.startswith("postgresql:///xhpc?host=/"), url
    done = _login2(psql, url, "-X", "-At", "-c", "select 1, current_user, current_database()")
    assert (done.returncode, done.stdout.strip()) == (0, "1|root|xhpc"), done.stderr
    assert f"postgres: on ({url})" in _dev("status").stdout


def test_login2_fail_kills_it_and_login2_up_brings_it_back(login2: None, tmp_path: Path) -> None:
    sleeper = subprocess.Popen([str(DEV_CLUSTER), "login2", "sleep", "300"], env=slurm_env())
    server: subprocess.Popen[bytes] | None = None
    port = free_port()
    try:
        # login2 execs the command: the child's own PID runs in the namespace.
        wait_for(lambda: sleeper.pid in _pids_inside(), 20, "the sleep inside login node 2")
        failed = _dev("login2-fail")
        assert failed.returncode == 0, failed.stderr
        killed = int(failed.stdout.split("(", 1)[1].split()[0])
        assert killed >= 1, failed.stdout
        assert sleeper.wait(timeout=20) == -9  # SIGKILL
        assert not _link_up()
        # Unreachable, not refused: nothing answers from 10.77.0.2 while its link is down.
        with pytest.raises(OSError) as unreachable:
            socket.create_connection((ADDRESS, port), timeout=2).close()
        assert not isinstance(unreachable.value, ConnectionRefusedError)

        up = _dev("login2-up")
        assert up.returncode == 0, up.stderr
        wait_for(_link_up, 10, f"{VETH} up")
        server = subprocess.Popen(
            [str(DEV_CLUSTER), "login2", sys.executable, "-m", "http.server", "--bind", ADDRESS,
             "--directory", str(tmp_path), str(port)],
            env=slurm_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def answers() -> bool:
            assert server is not None and server.poll() is None, "the http.server exited"
            try:
                with urllib.request.urlopen(f"http://{ADDRESS}:{port}/", timeout=2) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for(answers, 30, f"an answer from http://{ADDRESS}:{port}/ on login node 2")
    finally:
        for proc in (server, sleeper):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert server is not None and server.pid not in _pids_inside()
