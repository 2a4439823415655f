"""The agent starting a real (tiny, stdlib) engine: where it runs, and who gets the secret.

The engine is tests/data/engines/echo_engine.py run as a module (``python -m echo_engine``, the
way vLLM is run), the agent talks to a fake broker on loopback, and other users of the node
are played by files planted in shared directories and by a squatter listening on a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from xhpc.agent import agent as agent_mod
from xhpc.agent import launch as launch_mod
from xhpc.agent import ports
from xhpc.agent.agent import SECRET_FILE, SPEC_FILE, TOKEN_FILE, Agent
from xhpc.errors import EngineError
from xhpc.models import AgentSpec, EngineKind

pytestmark = pytest.mark.security

ENGINES = Path(__file__).resolve().parents[1] / "data" / "engines"
SECRET = "s3cret-of-m-0"
JOB = "77"


@dataclass
class FakeBroker:
    """Records what the agent reports; a registration ends the test's wait."""

    url: str = ""
    reports: list[dict[str, object]] = field(default_factory=list)
    registered: asyncio.Event = field(default_factory=asyncio.Event)

    async def report(self, request: web.Request) -> web.Response:
        self.reports.append(json.loads(await request.text()))
        return web.json_response({})

    async def register(self, request: web.Request) -> web.Response:
        self.registered.set()
        return web.json_response({})


@pytest.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    fake = FakeBroker()
    app = web.Application()
    app.router.add_post("/agent/v1/report", fake.report)
    app.router.add_post("/agent/v1/register", fake.register)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()


def _plant(directory: Path, marker: Path) -> None:
    """Modules another user could leave where the engine might import from: each one, if it
    ever runs, writes ``marker`` (with the environment it saw: the secret is in there)."""
    directory.mkdir(parents=True, exist_ok=True)
    code = (
        "import os, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text(repr(dict(os.environ)))\n"
        "raise SystemExit('planted module ran')\n"
    )
    for name in ("echo_engine.py", "sitecustomize.py", "usercustomize.py"):
        (directory / name).write_text(code)


def _replica(tmp_path: Path, broker: FakeBroker, **spec_kw: object) -> Path:
    rdir = tmp_path / "replica"
    rdir.mkdir(mode=0o700)
    (tmp_path / "broker.json").write_text(json.dumps({"agent_url": broker.url}))
    spec = AgentSpec(
        replica_id="m-0",
        deployment="m",
        engine=EngineKind.COMMAND,
        model_path="/models/m",
        served_model="m",
        python=sys.executable,
        command=(
            "{python}",
            "-m",
            "echo_engine",
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--served-model",
            "{served_model}",
        ),
        # The real engine module is found through PYTHONPATH; the scratch dir must never win.
        env={"PYTHONPATH": str(ENGINES)},
        startup_timeout_s=20,
        heartbeat_interval_s=0.2,
        broker_file=str(tmp_path / "broker.json"),
        **spec_kw,  # type: ignore[arg-type]
    )
    (rdir / SPEC_FILE).write_text(spec.model_dump_json())
    (rdir / TOKEN_FILE).write_text("agent-token")
    (rdir / SECRET_FILE).write_text(SECRET)
    return rdir


def _job_env(tmpdir: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "TMPDIR": str(tmpdir),
        "SLURM_JOB_ID": JOB,
    }


async def _run_until_registered(agent: Agent, broker: FakeBroker) -> tuple[int, Path]:
    """Run the agent until it registers; returns its exit code and the engine's cwd."""
    task = asyncio.create_task(agent.run())
    waiter = asyncio.create_task(broker.registered.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    cwd = Path("/nonexistent")
    if waiter in done:
        assert agent.child is not None
        cwd = Path(os.readlink(f"/proc/{agent.child.pid}/cwd"))
        st = cwd.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        agent.stop_event.set()
    waiter.cancel()
    return await asyncio.wait_for(task, 30), cwd


async def test_the_engine_never_imports_what_others_planted_in_tmpdir(
    tmp_path: Path, broker: FakeBroker
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)  # like /tmp: everyone may create entries here
    marker = tmp_path / "pwned"
    # The scratch path an earlier agent used, created by someone else before the job started,
    # and TMPDIR itself.
    _plant(tmpdir / f"xhpc-m-0-{JOB}", marker)
    _plant(tmpdir, marker)
    agent = Agent(_replica(tmp_path, broker), env=_job_env(tmpdir), in_pilot=True)
    code, cwd = await _run_until_registered(agent, broker)
    assert not marker.exists(), "planted code ran in the engine"
    assert broker.registered.is_set(), broker.reports
    assert code == 0
    assert cwd.parent == tmpdir and cwd.name != f"xhpc-m-0-{JOB}"
    assert not cwd.exists()  # the private scratch dir is removed when the agent ends


async def test_python_engines_start_with_a_safe_module_path(tmp_path: Path) -> None:
    """Python 3.11's safe path: neither the cwd nor '' comes first on the engine's sys.path,
    even in a directory the agent did not make (a site command that changes directory)."""
    from xhpc import runner
    from xhpc.agent.engines import engine_launch

    shared = tmp_path / "shared"
    marker = tmp_path / "pwned"
    _plant(shared, marker)
    spec = AgentSpec(
        replica_id="m-0",
        deployment="m",
        engine=EngineKind.COMMAND,
        model_path="/m",
        served_model="m",
        python=sys.executable,
        command=("{python}", "-m", "echo_engine", "--port", "{port}", "--crash-if", "/"),
        env={"PYTHONPATH": str(ENGINES)},
        broker_file="/b",
    )
    launch = engine_launch(
        spec, host="127.0.0.1", port=1, node_address="127.0.0.1", tmp_dir=shared, job_env={}
    )
    child = await runner.spawn(launch.argv, env=launch.env, output=tmp_path / "log", cwd=shared)
    await asyncio.wait_for(child.wait(), 30)
    assert not marker.exists(), "planted code ran in the engine"
    assert "crashing on start" in (tmp_path / "log").read_text()  # the real engine ran


# -- the port's owner ---------------------------------------------------------------------------
@contextlib.contextmanager
def _squatter(port: int) -> Iterator[list[bytes]]:
    """Another user's listener on ``port`` (loopback): it records what it is sent."""
    heard: list[bytes] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    sock.setblocking(False)
    stop = False

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while not stop:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError:
                return
            with conn:
                conn.setblocking(False)
                with contextlib.suppress(OSError, TimeoutError):
                    heard.append(await asyncio.wait_for(loop.sock_recv(conn, 65536), 2))

    task = asyncio.get_event_loop().create_task(serve())
    try:
        yield heard
    finally:
        stop = True
        task.cancel()
        sock.close()


async def test_the_secret_is_never_sent_to_a_port_squatter(
    tmp_path: Path, broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent picks a free port, releases it, starts the engine: another process may take
    the port in between. vLLM checks the secret itself, so its readiness probe carries it."""
    picked = launch_mod.free_port()
    monkeypatch.setattr(launch_mod, "free_port", lambda: picked)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # vLLM's launch (python -m ... --host 0.0.0.0 --port P), played by the echo engine.
    rdir = _replica(tmp_path, broker)
    spec = AgentSpec.model_validate_json((rdir / SPEC_FILE).read_text())
    vllm = spec.model_copy(update={"engine": EngineKind.VLLM, "startup_timeout_s": 10})
    (rdir / SPEC_FILE).write_text(vllm.model_dump_json())
    monkeypatch.setattr(
        launch_mod,
        "engine_launch",
        _as_echo_engine(launch_mod.engine_launch),
    )
    with _squatter(picked) as heard:
        agent = Agent(rdir, env=_job_env(tmpdir), in_pilot=True)
        code = await asyncio.wait_for(agent.run(), 30)
    assert code == 1
    assert not broker.registered.is_set()
    assert not any(SECRET.encode() in msg for msg in heard), "the squatter got the secret"
    failed = [r for r in broker.reports if r["phase"] == "failed"]
    assert failed and f"port {picked}" in str(failed[0]["detail"])
    assert "another process" in str(failed[0]["detail"])


def _as_echo_engine(real):  # type: ignore[no-untyped-def]
    """vLLM's environment (the secret in VLLM_API_KEY), the echo engine's argv."""

    def launch(spec: AgentSpec, **kw: object):  # type: ignore[no-untyped-def]
        out = real(spec, **kw)
        port = str(kw["port"])
        argv = (sys.executable, "-m", "echo_engine", "--host", "0.0.0.0", "--port", port)
        return out.model_copy(update={"argv": argv})

    return launch


async def test_an_engine_that_owns_its_port_gets_the_probe(
    tmp_path: Path, broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same vLLM-shaped start with nobody on the port: ready, registered."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    rdir = _replica(tmp_path, broker)
    spec = AgentSpec.model_validate_json((rdir / SPEC_FILE).read_text())
    (rdir / SPEC_FILE).write_text(
        spec.model_copy(update={"engine": EngineKind.VLLM}).model_dump_json()
    )
    monkeypatch.setattr(launch_mod, "engine_launch", _as_echo_engine(launch_mod.engine_launch))
    agent = Agent(rdir, env=_job_env(tmpdir), in_pilot=True)
    code, _ = await _run_until_registered(agent, broker)
    assert broker.registered.is_set(), broker.reports
    assert code == 0


def test_a_listener_is_the_engines_only_when_its_process_tree_holds_the_socket() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert ports.listening_inodes(port)  # seen in tcp6, as dual-stack listeners are
        assert ports.engine_listens(port, os.getpid())  # this process and its children
        other = subprocess.Popen(["sleep", "30"])  # a process that holds no socket
        try:
            with pytest.raises(EngineError, match=f"port {port} is held by another process"):
                ports.engine_listens(port, other.pid)
        finally:
            other.kill()
            other.wait()
    assert not ports.engine_listens(port, os.getpid())  # nobody listens: not yet


def test_picked_ports_lie_outside_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    # A port the kernel hands out itself (an outgoing connection, a bind to port 0: another
    # engine's own sockets) could be given to someone else between the agent's pick and the
    # engine's bind; the NIXL side channel died of that. Picks stay below and above the range.
    rng = tmp_path / "ip_local_port_range"
    rng.write_text("20000\t60999\n")
    picked = {ports.free_port(rng) for _ in range(200)}
    assert picked and all(ports.LOWEST_PORT <= p < 20000 or p > 60999 for p in picked)
    assert len(picked) > 100  # spread out: two agents of one node rarely pick the same
    for p in list(picked)[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", p))  # free when picked


def test_a_taken_port_is_never_picked_and_a_full_range_falls_back_to_the_kernel(
    tmp_path: Path,
) -> None:
    rng = tmp_path / "ip_local_port_range"
    rng.write_text(f"{ports.LOWEST_PORT} 65534")  # room for 65535 alone
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        try:
            holder.bind(("127.0.0.1", 65535))  # on one address: 0.0.0.0 conflicts with it
        except OSError:
            pytest.skip("port 65535 is in use on this machine")
        holder.listen(1)
        low, high = ports.ephemeral_range()
        fallback = ports.free_port(rng)
        assert fallback != 65535 and low <= fallback <= high
    assert ports.free_port(rng) == 65535  # let go: the one port outside is free again
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)


async def test_the_engines_context_length_is_read_from_its_model_card() -> None:
    cards: dict[str, object] = {}
    seen: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(cards)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:

            async def ask() -> int | None:
                return await agent_mod.context_length(session, base, "/m/served", "s3cret")

            cards["data"] = [
                {"id": "other", "max_model_len": 9},
                {"id": "/m/served", "max_model_len": 2048},
            ]
            assert await ask() == 2048  # its own card, not the first
            cards["data"] = [{"id": "x", "max_model_len": 512}]
            assert await ask() == 512  # one card, whatever its name
            for bad in (
                [{"id": "/m/served"}],
                [{"id": "/m/served", "max_model_len": "4"}],
                "no",
                None,
            ):
                cards["data"] = bad
                assert await ask() is None
            assert seen[0] == "Bearer s3cret"
        async with aiohttp.ClientSession() as session:
            await runner.cleanup()
            assert await agent_mod.context_length(session, base, "m", None) is None  # gone
    finally:
        await runner.cleanup()
