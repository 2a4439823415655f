"""One replica on several nodes: each node's agent finds its rank and rank 0's rendezvous.

A replica that spans N nodes is one Slurm job with one ``srun`` step of one task per node
(``--kill-on-bad-exit``: when any task ends badly, Slurm ends the others). Every task runs an
agent; its rank is its node's index in the job (``SLURM_NODEID``). Rank 0 picks the port of
the engine's rendezvous store on its node and writes it, with its node's address, to a file in
the replica's directory (owner-only, on the filesystem every node sees), named for the job and
its run so that an earlier run's file is never read; the other ranks wait for that file, then
start their part of the engine ``--headless``. Rank 0's agent alone registers the replica,
proves it answers and heartbeats; the others watch their engine and stage the weights on their
own node.

A lost rank is the head's to notice, fast: vLLM itself answers ``/health`` for minutes with a
dead rank, and Slurm takes tens of seconds to call a silent node down. So every other rank
touches a file of its own in the replica directory at each heartbeat, and the head fails the
replica (its agent exits badly, which ends the whole step) when one has not for
``silence_s``. The head's own end removes the rendezvous file: the other ranks stop then.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]

from xhpc.agent.engines import Rank
from xhpc.agent.ports import free_port
from xhpc.clock import monotonic
from xhpc.errors import EngineError

RENDEZVOUS_POLL_S = 0.2


def node_rank(env: Mapping[str, str]) -> int:
    """This task's rank: its node's index in the job (``SLURM_NODEID``; 0 outside a step)."""
    value = env.get("SLURM_NODEID", "0")
    return int(value) if value.isdigit() else 0


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (None: none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return str(name)
    return None


def rendezvous_file(replica_dir: Path, job_id: str, restarts: int) -> Path:
    return replica_dir / f"rendezvous-{job_id}-{restarts}.json"


def write_rendezvous(path: Path, address: str, port: int) -> None:
    """Rank 0's address and store port, written whole (a reader sees all of it or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"address": address, "port": port}, fh)
    os.replace(tmp, path)


def head_rank(nodes: int, address: str, path: Path) -> Rank:
    """Rank 0: a free port on its node for the rendezvous store, told to the other ranks."""
    port = free_port()
    write_rendezvous(path, address, port)
    return Rank(
        rank=0, nodes=nodes, master_addr=address, master_port=port, interface=interface_of(address)
    )


async def member_rank(
    rank: int, nodes: int, address: str, path: Path, deadline_s: float, stop: asyncio.Event
) -> Rank:
    """Rank ``rank`` > 0, once rank 0 has written where its rendezvous store listens."""
    end = monotonic() + deadline_s
    while monotonic() < end and not stop.is_set():
        try:
            data = json.loads(path.read_text())
            head, port = str(data["address"]), int(data["port"])
        except (OSError, ValueError, KeyError, TypeError):
            await asyncio.sleep(RENDEZVOUS_POLL_S)
            continue
        return Rank(
            rank=rank,
            nodes=nodes,
            master_addr=head,
            master_port=port,
            interface=interface_of(address),
        )
    raise EngineError(f"rank {rank}: rank 0 told no rendezvous within {deadline_s:.0f}s")


def alive_file(rendezvous: Path, rank: int) -> Path:
    """Where rank ``rank`` (> 0) shows it is alive: beside the rendezvous file of its run."""
    return rendezvous.with_name(f"{rendezvous.stem}-rank{rank}.alive")


def touch_alive(path: Path, node: str) -> None:
    """Rank > 0's heartbeat: the file names its node, and its modification time is now."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, node.encode())
    finally:
        os.close(fd)


def rank_node(rendezvous: Path, rank: int) -> str | None:
    """The node rank ``rank`` said it runs on (None: it never said)."""
    try:
        return alive_file(rendezvous, rank).read_text().strip() or None
    except OSError:
        return None


def silence_s(heartbeat_interval_s: float) -> float:
    """How long a rank may be silent before the head calls it lost."""
    return max(3.0, 2.5 * heartbeat_interval_s)


def silent_ranks(rendezvous: Path, nodes: int, since: float, limit_s: float) -> list[int]:
    """The ranks > 0 that have not shown they are alive for ``limit_s`` (a rank that never did:
    counted from ``since``, the head's start, wall-clock seconds)."""
    now = time.time()
    silent: list[int] = []
    for rank in range(1, nodes):
        try:
            last = max(alive_file(rendezvous, rank).stat().st_mtime, since)
        except OSError:
            last = since
        if now - last > limit_s:
            silent.append(rank)
    return silent
