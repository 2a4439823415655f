"""Concurrency caps and quota reservations hold for the whole gateway: each worker publishes its
holds of a key and counts the others' (real files, real processes); a worker that exits has its
holds given back."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from xhpc.access import KeyGrant
from xhpc.proxy.tenants.keys import KeyBook, KeyRefused
from xhpc.proxy.tenants.quota import Hold, Holds
from xhpc.proxy.tenants.shared_holds import SharedHolds


def holds(directory: Path, worker: str) -> Holds:
    return Holds(shared=SharedHolds(directory, worker))


def test_a_cap_holds_across_workers_and_an_exited_workers_slots_come_back(
    tmp_path: Path,
) -> None:
    d = tmp_path / "holds"
    w0, w1 = holds(d, "w0"), holds(d, "w1")
    first, second, third = Hold("k"), Hold("k"), Hold("k")
    assert w0.enter(first, cap=2) and w1.enter(second, cap=2)
    assert not w0.enter(third, cap=2) and not w1.enter(Hold("k"), cap=2)
    assert w0.enter(Hold("other"), cap=2)  # another key counts apart
    w1.release(second)
    assert w0.enter(third, cap=2)
    assert not w1.enter(Hold("k"), cap=2)
    SharedHolds.forget(d, "w0")  # w0 died with two requests in flight
    assert w1.enter(Hold("k"), cap=2) and w1.enter(Hold("k"), cap=2)
    assert d.stat().st_mode & 0o777 == 0o700


def test_reservations_count_across_workers(tmp_path: Path) -> None:
    d = tmp_path / "holds"
    w0, w1 = holds(d, "w0"), holds(d, "w1")
    a = Hold("k")
    w0.reserve(a, 300)
    w1.reserve(Hold("k"), 200)
    assert w0.reserved_by_all("k") == 500 and w1.reserved_by_all("k") == 500
    w0.release(a)
    assert w1.reserved_by_all("k") == 200
    assert Holds().reserved_by_all("k") == 0  # a lone worker counts its own only


def test_a_quota_refuses_when_another_worker_reserved_the_rest(tmp_path: Path) -> None:
    grant = KeyGrant(key_id="k", digest="x", user="carol", token_quota=1000)
    books = [KeyBook(holds=holds(tmp_path, name)) for name in ("w0", "w1")]
    hold = books[0].enter(grant)
    books[0].reserve(grant, hold, 1000)  # the whole quota, reserved by the other worker
    other = books[1].enter(grant)
    try:
        books[1].reserve(grant, other, 200)
    except KeyRefused as err:
        assert err.status == 429 and "reserved" in str(err)
    else:
        raise AssertionError("the second worker reserved past the quota")
    books[0].finish(grant, hold, "m", None, answered=False)
    books[1].reserve(grant, other, 200)  # given back: room again


def _take(directory: Path, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import os

    mine = holds(directory, f"p{os.getpid()}")
    out.put(sum(mine.enter(Hold("k"), cap=5) for _ in range(10)))


def test_processes_racing_never_take_more_than_the_cap(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_take, args=(tmp_path / "h", out)) for _ in range(4)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(30)
    assert total == 5  # 40 tries, exactly the cap
