"""Rate buckets shared by a gateway's workers: a key's rpm holds for the gateway."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from xhpc.proxy.tenants.rates import SharedBuckets


def test_two_workers_share_one_bucket(tmp_path: Path) -> None:
    a, b = SharedBuckets(tmp_path / "rates"), SharedBuckets(tmp_path / "rates")
    taken = [x.take("k1", 3, now=100.0) >= 1.0 for x in (a, b, a, b, a)]
    assert taken == [True, True, True, False, False]
    # Another key has its own bucket; a second later a third of a token is back (3 a minute).
    assert b.take("k2", 3, now=100.0) >= 1.0
    assert a.take("k1", 3, now=101.0) < 1.0
    assert a.take("k1", 3, now=120.0) >= 1.0  # 20 s: one token
    assert (tmp_path / "rates").stat().st_mode & 0o777 == 0o700
    a.close()
    b.close()


def _burst(directory: Path, n: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    buckets = SharedBuckets(directory)
    out.put(sum(buckets.take("k", 50, now=1000.0) >= 1.0 for _ in range(n)))


def test_processes_racing_never_take_more_than_the_rate(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_burst, args=(tmp_path / "r", 40, out)) for _ in range(4)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(30)
    assert total == 50  # 160 tries, exactly the 50 the bucket holds
