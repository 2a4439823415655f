"""The leader's lease (``xhpc.store.lease``) between brokers that share one SQLite database
(two stores on one file, as two broker processes would have): one holder at a time, a token
one more at each new holder, and a former holder fenced: its renewal fails and its writes are
rolled back, however long it thought it led; its Slurm calls refused; and a gateway ignores its
routing tables while the new leader answers."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from xhpc.clock import utcnow
from xhpc.errors import FencedError
from xhpc.proxy.lab import BrokerLink
from xhpc.proxy.source import EPOCH_GRACE_S, stale_epoch
from xhpc.settings import SlurmConfig
from xhpc.slurm.client import CliSlurmClient
from xhpc.store import Store
from xhpc.store.lease import Lease


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


def _pair(tmp_path: Path, clock: Clock) -> tuple[Lease, Lease]:
    db = tmp_path / "x.db"
    a = Lease(Store(db), "login1:100", ttl_s=10, clock=clock)
    b = Lease(Store(db), "login2:200", ttl_s=10, clock=clock)
    return a, b


def test_one_holder_a_new_token_at_each_takeover_and_the_former_one_fenced(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _pair(tmp_path, clock)
    assert a.acquire() and a.token == 1
    assert not b.acquire() and b.token is None  # held, and not run out
    clock.now += timedelta(seconds=8)
    assert a.renew() and not b.acquire()  # renewed: 10 s from now again
    a.store.fence = a.check
    a.store.add_event(None, "d", "note", "written while it leads")

    # a is paused past its lease: b takes over, with the next token.
    clock.now += timedelta(seconds=11)
    assert b.acquire() and b.token == 2
    b.store.fence = b.check
    state = b.state()
    assert state is not None and (state.holder, state.token) == ("login2:200", 2)

    # a resumes: its writes are refused and rolled back, its renewal fails.
    assert not a.held()
    with pytest.raises(FencedError, match="login2:200 \\(token 2\\) holds it"):
        a.store.add_event(None, "d", "note", "written after the takeover")
    b.store.add_event(None, "d", "note", "the new leader's")
    notes = [e.message for e in b.store.events(limit=10)]
    assert "written after the takeover" not in notes
    assert {"written while it leads", "the new leader's"} <= set(notes)
    assert not a.renew() and a.token is None
    assert not a.acquire()  # b's lease has not run out


def test_a_clean_stop_hands_over_at_once(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _pair(tmp_path, clock)
    assert a.acquire()
    a.release()
    assert a.token is None and b.acquire() and b.token == 2


def test_of_many_that_find_it_free_at_once_exactly_one_takes_it(tmp_path: Path) -> None:
    clock = Clock()
    db = tmp_path / "x.db"
    first = Lease(Store(db), "login0:1", ttl_s=10, clock=clock)
    assert first.acquire()
    clock.now += timedelta(seconds=30)  # run out: free for whoever comes first
    leases = [Lease(Store(db), f"login{i}:2", ttl_s=10, clock=clock) for i in range(1, 9)]
    won: list[bool] = [False] * len(leases)
    start = threading.Barrier(len(leases))

    def take(i: int) -> None:
        start.wait()
        won[i] = leases[i].acquire()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(won) == 1, won
    winner = leases[won.index(True)]
    state = winner.state()
    assert state is not None and (state.holder, state.token) == (winner.holder, 2)


def _fake_slurm(tmp_path: Path) -> Path:
    """sbatch, scancel and scontrol that record each call in ``calls``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, out in (("sbatch", "4242"), ("scancel", ""), ("scontrol", "")):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/calls\necho '{out}'\n")
        script.chmod(0o755)
    return bin_dir


async def test_a_former_holder_submits_cancels_and_requeues_nothing(tmp_path: Path) -> None:
    """The Slurm chokepoint asks the lease before each call that acts on jobs: the holder's
    go through; once another holds the lease none is made."""
    clock = Clock()
    a, b = _pair(tmp_path, clock)
    slurm = CliSlurmClient(SlurmConfig(bin_dir=_fake_slurm(tmp_path)))
    slurm.guard = a.assert_held
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/sh\n")
    assert a.acquire()
    assert await slurm.submit(script) == "4242"
    await slurm.cancel(["4242"])
    await slurm.requeue(["4242"])
    assert (tmp_path / "calls").read_text().split() == ["sbatch", "scancel", "scontrol"]
    clock.now += timedelta(seconds=11)
    assert b.acquire()
    for call in (slurm.submit(script), slurm.cancel(["4242"]), slurm.requeue(["4242"])):
        with pytest.raises(FencedError, match="submits and cancels no job"):
            await call
    assert (tmp_path / "calls").read_text().split() == ["sbatch", "scancel", "scontrol"]


def test_a_gateway_ignores_a_former_leaders_table_while_the_new_leader_answers() -> None:
    link = BrokerLink(Path("/x/broker.sock"))
    assert not stale_epoch(link, 1, now=100.0)  # the first leader's
    assert not stale_epoch(link, 2, now=101.0)  # a takeover: the new leader's
    assert stale_epoch(link, 1, now=102.0)  # the former leader, resumed: ignored
    assert not stale_epoch(link, 2, now=130.0) and link.epoch_at == 130.0
    assert stale_epoch(link, 1, now=130.0 + EPOCH_GRACE_S - 1)
    # Nothing from token 2 for the grace: a lower token leads now (a state restored from a
    # backup made before the takeovers).
    assert not stale_epoch(link, 1, now=130.0 + EPOCH_GRACE_S + 1) and link.epoch == 1
