"""Active and standby brokers on one state (``xhpc broker --standby``, xhpc.store.lease), as
real processes: the standby waits while the leader renews its lease; the leader frozen past its
lease (SIGSTOP), the standby leads within seconds and answers on the control socket; the former
leader, resumed, finds its lease gone and stops with a one-line error, leaving the new leader's
socket in place. A broker started without --standby beside a live leader is refused. No Slurm
is needed (their reconcile passes fail, and say so)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SITE, XHPC, freeze_until_taken_over, wait_for
from xhpc.paths import host_socket_path, reachable_socket


@pytest.fixture
def state() -> Iterator[tuple[Path, dict[str, str]]]:
    state_dir = Path(tempfile.mkdtemp(prefix="xt-lease-", dir="/tmp"))
    (state_dir / "user.toml").write_text('[broker]\nlease_s = 2\nagent_bind = "127.0.0.1"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_SITE_CONFIG=str(SITE), XHPC_STATE_DIR=str(state_dir),
               XHPC_USER_CONFIG=str(state_dir / "user.toml"))  # fmt: skip
    yield state_dir, env
    subprocess.run(["rm", "-rf", str(state_dir)], check=False)


def _broker(state_dir: Path, env: dict[str, str], name: str, *args: str) -> subprocess.Popen[bytes]:
    log = (state_dir / f"{name}.log").open("wb")
    return subprocess.Popen([XHPC, "broker", *args], env=env, stdout=log, stderr=log)


def _log(state_dir: Path, name: str) -> str:
    return (state_dir / f"{name}.log").read_text(errors="replace")


def _lease(state_dir: Path) -> tuple[str, int]:
    with sqlite3.connect(state_dir / "xhpc.db", timeout=10) as db:
        expires, token = db.execute("SELECT expires_at, token FROM leases").fetchone()
    return str(expires), int(token)


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def test_a_frozen_leader_is_fenced_and_the_standby_leads(
    state: tuple[Path, dict[str, str]],
) -> None:
    state_dir, env = state
    sock = state_dir / "broker.sock"
    a = _broker(state_dir, env, "a")
    b = None
    try:
        wait_for(lambda: "broker leads (lease token 1)" in _log(state_dir, "a"), 30, "a leading")
        wait_for(sock.exists, 30, "a's socket")
        plain = subprocess.run([XHPC, "broker"], env=env, capture_output=True, text=True,
                               timeout=60)  # fmt: skip
        assert plain.returncode != 0 and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
        assert "another broker already runs" in plain.stderr  # its lock, before its lease
        b = _broker(state_dir, env, "b", "--standby")
        wait_for(lambda: "standby: broker" in _log(state_dir, "b"), 30, "b waiting as standby")
        # a renews its lease twice while b waits: b does not take over a live leader's lease.
        seen: set[str] = set()

        def renewed_twice() -> bool:
            expires, token = _lease(state_dir)
            assert token == 1
            seen.add(expires)
            return len(seen) >= 3

        wait_for(renewed_twice, 30, "a renewing its lease")
        assert "standby takes over" not in _log(state_dir, "b")
        first = sock.stat().st_ino

        # frozen past its 2 s lease (again, if frozen holding SQLite's write lock)
        took = freeze_until_taken_over(a, lambda: _log(state_dir, "b"))
        assert took < 10, took
        assert "lease token 2" in _log(state_dir, "b")
        wait_for(lambda: sock.exists() and sock.stat().st_ino != first, 15, "b's socket")
        ps = subprocess.run([XHPC, "ps", "--json"], env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
        assert ps.returncode == 0, ps.stderr

        a.send_signal(signal.SIGCONT)  # it finds its lease gone: it stops, refusing to act
        assert a.wait(30) == 4, _log(state_dir, "a")[-2000:]
        tail = _log(state_dir, "a").strip().splitlines()[-1]
        assert "lost its lease" in tail and tail.startswith("error:"), tail
        assert sock.exists() and sock.stat().st_ino != first  # b's socket left in place
        assert b.poll() is None
    finally:
        _stop(*(p for p in (a, b) if p is not None))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_a_standby_on_another_login_node_relays_to_the_leader(
    state: tuple[Path, dict[str, str]],
) -> None:
    """The leader runs under another host name (its own UTS namespace: login node "lb");
    the standby on this host serves this login node's socket as a relay to it (xhpc.broker
    .relay), which clients here prefer: they are answered with the leader's socket moved
    away. The leader killed, the standby leads and serves that socket itself."""
    state_dir, env = state
    leader_sock, here = state_dir / "broker.sock", host_socket_path(state_dir / "broker.sock")
    inside = 'hostname lb && exec "$@"'
    a = subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", inside, "sh", XHPC, "broker"],
        env=env,
        stdout=(state_dir / "a.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    b = None
    try:
        wait_for(lambda: "broker leads (lease token 1)" in _log(state_dir, "a"), 30, "a leading")
        wait_for(lambda: (state_dir / "broker.lb.sock").exists(), 30, "a's own socket")
        assert json.loads((state_dir / "broker.json").read_text())["relay"] is True
        b = _broker(state_dir, env, "b", "--standby")
        wait_for(lambda: "relays to the leader" in _log(state_dir, "b"), 30, "b relaying")
        assert reachable_socket(leader_sock) == here
        leader_sock.rename(state_dir / "away.sock")  # only the relay is left to answer here
        try:
            ps = subprocess.run([XHPC, "ps", "--json"], env=env, capture_output=True,
                                text=True, timeout=60)  # fmt: skip
            assert ps.returncode == 0 and json.loads(ps.stdout) == [], ps.stderr
        finally:
            (state_dir / "away.sock").rename(leader_sock)

        a.kill()  # the leader's login node gone: b leads, and serves this socket itself
        a.wait(10)
        wait_for(lambda: "standby takes over" in _log(state_dir, "b"), 30, "b leading")
        wait_for(lambda: "broker up" in _log(state_dir, "b"), 15, "b serving")  # both sockets
        ps = subprocess.run([XHPC, "ps", "--json"], env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
        assert ps.returncode == 0, ps.stderr
        assert "relays to the leader" in _log(state_dir, "b")  # before it led, not after
    finally:
        _stop(*(p for p in (a, b) if p is not None))
