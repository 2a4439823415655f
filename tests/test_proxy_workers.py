"""`xhpc proxy --workers 2` as a real process tree under steady traffic: a worker killed with -9,
a reload (SIGHUP) and a stop (SIGTERM).

The broker and the engine are bench/_backend.py (one process: an OpenAI-shaped backend on
loopback, and the stand-in broker on its UNIX socket answering the routing table). Clients are
bounded loops of aiohttp requests on keep-alive connections; every answer is checked byte for
byte against what the backend answers directly. Every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.proxy_fakes import free_port
from xhpc.errors import XhpcError
from xhpc.proxy.process.supervisor import listen_sockets

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "bench" / "_backend.py"
START_S = 30.0  # a process tree to start on a busy 2-core machine
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
# The backend always ends a stream with a usage chunk; a client that asks for it gets it through
# the proxy too (one that does not would not: the proxy takes out what it alone asked for).
STREAM = json.dumps(
    {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
).encode()
HEADERS = {"Content-Type": "application/json"}
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30)


async def until(cond: Callable[[], object], what: str, timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)


def children(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.add(int(entry.name))
    return found


def sockets(pid: int) -> int:
    """How many sockets ``pid`` holds open (a worker with clients holds more)."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


@dataclass
class Tree:
    """The backend (and stand-in broker) and the proxy's supervisor, as started by the test."""

    tmp: Path
    backend_url: str
    proxy: subprocess.Popen[bytes]
    url: str
    log: Path
    metrics_url: str  # proxy.metrics_listen: /metrics with no key, on its own socket

    def workers(self) -> set[int]:
        return children(self.proxy.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def logged(self, text: str) -> bool:
        return text in self.log_text()

    def hold(self) -> None:
        """From now on the backend's streams hold their last event back..."""
        (self.tmp / "hold").touch()

    def release(self) -> None:
        """... until this: then they end."""
        (self.tmp / "hold").unlink()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def process_tree(tmp: Path, tokens: int, interval_ms: int, proxy_toml: str = "") -> Iterator[Tree]:
    """The backend and `xhpc proxy --workers 2`; ``proxy_toml``: more ``[proxy]`` settings."""
    state = tmp / "state"
    state.mkdir()
    port, metrics_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{port}"
    route = {"model": "m", "replica_id": "r0", "url": backend_url, "served_model": "m"}
    table = {"version": 1, "models": ["m"], "routes": [route]}
    (tmp / "answers.json").write_text(json.dumps({"/v1/proxy/sync": table}))
    (tmp / "user.toml").write_text(
        '[proxy]\nhost = "127.0.0.1"\nport = 0\nauth = "none"\n'
        "refresh_interval_s = 0.2\ndrain_grace_s = 20.0\n"
        f'metrics_listen = "127.0.0.1:{metrics_port}"\n' + proxy_toml
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_STATE_DIR=str(state), XHPC_USER_CONFIG=str(tmp / "user.toml"))
    log = tmp / "proxy.log"
    backend_argv = [
        sys.executable, str(BACKEND), "--port", str(port), "--ready-file", str(tmp / "port"),
        "--tokens", str(tokens), "--interval-ms", str(interval_ms),
        "--hold-file", str(tmp / "hold"),
        "--broker-socket", str(state / "broker.sock"), "--broker-answers",
        str(tmp / "answers.json"),
    ]  # fmt: skip
    proxy_argv = [sys.executable, "-m", "xhpc", "proxy", "--workers", "2"]
    backend = subprocess.Popen(backend_argv, cwd=ROOT, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        ready = tmp / "proxy.url"
        with log.open("wb") as out:
            proxy = subprocess.Popen(
                [*proxy_argv, "--ready-file", str(ready)], env=env, stderr=out, cwd=ROOT
            )
        deadline = time.monotonic() + START_S
        while not (ready.exists() and (tmp / "port").exists()):
            assert proxy.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the proxy did not start:\n{log.read_text()}"
            time.sleep(0.05)
        url = ready.read_text().strip()
        yield Tree(tmp, backend_url, proxy, url, log, f"http://127.0.0.1:{metrics_port}")
    finally:
        if proxy is not None:
            _stop(proxy)
        _stop(backend)


@dataclass
class Traffic:
    """``conns`` client loops sending chat requests until stopped, each ``pace_s`` after its
    last answer (steady traffic that leaves the CPU to the processes under test); each answer
    must be 200 with exactly ``expected`` as its body."""

    url: str
    expected: bytes
    conns: int = 4
    pace_s: float = 0.02
    ok: int = 0
    in_flight: int = 0
    closes: int = 0  # answers that said Connection: close
    failures: list[str] = field(default_factory=list)

    async def loop(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.in_flight += 1
            try:
                async with session.post(self.url, data=CHAT, headers=HEADERS) as resp:
                    body = await resp.read()
                    if resp.headers.get("Connection", "").lower() == "close":
                        self.closes += 1
                    if resp.status == 200 and body == self.expected:
                        self.ok += 1
                    else:
                        self.failures.append(f"{resp.status}: {body[:300]!r}")
            except (aiohttp.ClientError, TimeoutError) as err:
                self.failures.append(f"{type(err).__name__}: {err}")
            finally:
                self.in_flight -= 1
            if self.pace_s:
                await asyncio.sleep(self.pace_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Traffic]:
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
            loops = [asyncio.create_task(self.loop(session, stop)) for _ in range(self.conns)]
            try:
                yield self
            finally:
                stop.set()
                await asyncio.gather(*loops)

    async def more(self, n: int) -> None:
        """Wait until ``n`` more answers came back right."""
        mark = self.ok
        await until(lambda: self.ok >= mark + n, f"{n} more answers ({self.failures[:3]})")


async def fetch(url: str, body: bytes, started: asyncio.Event | None = None) -> tuple[int, bytes]:
    """POST ``body``; the status and every byte of the answer (``started`` set at the first)."""
    async with (
        aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session,
        session.post(url + "/v1/chat/completions", data=body, headers=HEADERS) as resp,
    ):
        got = b""
        async for chunk in resp.content.iter_any():
            got += chunk
            if started is not None:
                started.set()
        return resp.status, got


Fetch = asyncio.Task[tuple[int, bytes]]


async def streams(tree: Tree, n: int) -> tuple[list[Fetch], Fetch]:
    """``n`` streams through the proxy, once each has its first bytes; and the same stream
    straight from the backend (it runs alongside, so it costs no extra time)."""
    firsts = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(fetch(tree.url, STREAM, e)) for e in firsts]
    direct = asyncio.create_task(fetch(tree.backend_url, STREAM))
    await until(lambda: all(e.is_set() for e in firsts), "the streams' first events")
    return tasks, direct


async def whole(direct: Fetch) -> bytes:
    status, raw = await direct
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    return raw


async def plain_answer(tree: Tree) -> bytes:
    status, body = await fetch(tree.backend_url, CHAT)
    assert status == 200
    return body


async def test_a_worker_killed_with_sigkill_is_restarted_and_only_its_requests_fail(
    tmp_path: Path,
) -> None:
    with process_tree(tmp_path, tokens=4, interval_ms=5) as tree:
        # Back to back, so that requests are in flight on the worker when it is killed.
        traffic = Traffic(tree.url + "/v1/chat/completions", await plain_answer(tree), pace_s=0.0)
        async with traffic.running():
            await traffic.more(50)
            before = tree.workers()
            assert len(before) == 2, tree.log_text()
            victim = max(before, key=sockets)  # the one the clients are connected to
            in_flight = traffic.in_flight  # read right at the kill: no await in between
            os.kill(victim, signal.SIGKILL)
            await until(lambda: victim not in tree.workers(), "the killed worker to be gone")
            await until(lambda: len(tree.workers()) == 2, "a second worker again")
            (new,) = tree.workers() - before
            await until(lambda: tree.logged(f"proxy worker {new} serving"), "the new one serving")
            failed = len(traffic.failures)
            await traffic.more(100)
        assert 0 < failed <= in_flight, traffic.failures
        assert len(traffic.failures) == failed, traffic.failures  # none once it serves again
        log = tree.log_text()
        assert f"(pid {victim}) was killed by SIGKILL; restarting it in" in log


async def test_a_reload_that_cannot_start_keeps_the_old_workers_and_one_that_can_fails_nothing(
    tmp_path: Path,
) -> None:
    """Under traffic: a reload whose workers cannot start (a bad config) is abandoned and the
    old workers keep serving; the next one (the config fixed) replaces them, and the streams the
    old ones carry finish whole before they exit."""
    with process_tree(tmp_path, tokens=4, interval_ms=5) as tree:
        traffic = Traffic(tree.url + "/v1/chat/completions", await plain_answer(tree))
        async with traffic.running():
            await traffic.more(50)
            old = tree.workers()
            assert len(old) == 2, tree.log_text()
            config = tmp_path / "user.toml"
            good = config.read_text()
            config.write_text("[proxy]\nno_such_key = 1\n")  # read on reload
            tree.proxy.send_signal(signal.SIGHUP)
            await until(lambda: tree.logged("reload abandoned"), "the reload to be abandoned")
            await until(lambda: tree.workers() == old, "only the old workers")
            assert "invalid config at proxy.no_such_key" in tree.log_text()
            await traffic.more(50)

            config.write_text(good)
            tree.hold()
            tasks, direct = await streams(tree, 3)
            tree.proxy.send_signal(signal.SIGHUP)
            await until(lambda: tree.logged("reload: new workers ready"), "the new workers")
            await traffic.more(50)  # served by the new workers while the old ones hold streams
            # an old worker with a stream lives on (one with none has exited)
            assert not any(t.done() for t in tasks) and tree.workers() & old
            tree.release()
            await until(lambda: not tree.workers() & old, "the old workers to exit")
            assert all(t.done() for t in tasks), "an old worker exited before its stream ended"
            assert len(tree.workers()) == 2
            await traffic.more(100)
        want = await whole(direct)
        for task in tasks:
            assert await task == (200, want)
        assert traffic.failures == []
        assert traffic.closes > 0  # keep-alive clients of the old workers were told to go
        assert tree.proxy.poll() is None


async def _idle_connection(url: str) -> asyncio.StreamReader:
    """A connection that was answered once and now waits for its next request (an SDK's pool);
    its reader, which reads EOF once the proxy closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return reader


async def test_sigterm_closes_idle_connections_at_once_and_exits_0_once_streams_are_done(
    tmp_path: Path,
) -> None:
    """SIGTERM: the port closes, connections waiting for their next request are closed at once
    (they do not hold the drain to its grace period), the streams in flight finish whole, then
    the tree exits 0."""
    with process_tree(tmp_path, tokens=4, interval_ms=5) as tree:
        traffic = Traffic(tree.url + "/v1/chat/completions", await plain_answer(tree))
        async with traffic.running():
            await traffic.more(50)
        idle = [await _idle_connection(tree.url) for _ in range(8)]
        tree.hold()
        tasks, direct = await streams(tree, 2)
        workers = tree.workers()
        tree.proxy.send_signal(signal.SIGTERM)
        for reader in idle:
            assert await asyncio.wait_for(reader.read(), START_S) == b""
        assert tree.proxy.poll() is None and not any(t.done() for t in tasks)
        tree.release()
        results = await asyncio.gather(*tasks)
        returncode = await asyncio.to_thread(tree.proxy.wait, 30)
        want = await whole(direct)
        assert results == [(200, want)] * 2
        assert returncode == 0, tree.log_text()
        assert traffic.failures == []
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
        assert not (tmp_path / "proxy.url").exists()
        log = tree.log_text()
        assert log.count("drained in") == 2 and "cut at the grace period" not in log, log


def test_listen_sockets_share_one_port_and_refuse_a_taken_one() -> None:
    sockets = listen_sockets("localhost", 0)
    try:
        assert len({s.getsockname()[1] for s in sockets}) == 1
        with pytest.raises(XhpcError, match="cannot listen"):
            listen_sockets("127.0.0.1", sockets[0].getsockname()[1])
    finally:
        for s in sockets:
            s.close()
