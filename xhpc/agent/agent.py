"""The in-job agent: starts the engine, proves it answers, registers, heartbeats, stops cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from xhpc import runner
from xhpc.agent.engines import EngineLaunch, Rank
from xhpc.agent.guard import EngineGuard
from xhpc.agent.launch import start_engine
from xhpc.agent.liveness import LivenessPort
from xhpc.agent.ports import engine_listens, free_port
from xhpc.agent.private import scratch_dir
from xhpc.agent.ranks import (
    alive_file,
    head_rank,
    member_rank,
    node_rank,
    rank_node,
    rendezvous_file,
    silence_s,
    silent_ranks,
    touch_alive,
)
from xhpc.agent.staging import stage
from xhpc.clock import monotonic
from xhpc.errors import EngineError, UnsafePathError
from xhpc.models import AgentRegistration, AgentReport, AgentSpec, StagedCopy
from xhpc.weights import WeightsError
from xhpc.wire import WIRE_HEADER, WIRE_VERSION

log = logging.getLogger(__name__)

SPEC_FILE = "spec.json"
TOKEN_FILE = "token"
SECRET_FILE = "engine_secret"  # the replica's own secret: the proxy presents it to the engine
GONE = 410
# A call to the broker that takes longer is given up and the broker's address read again: a
# broker frozen past its lease (a standby leads now, xhpc.store.lease) holds it no longer.
BROKER_CALL_S = 15.0
# A broker that does not take the connection in this long is gone (its login node down or cut
# off: no refusal comes): its address is read again, since a standby may lead elsewhere by now.
BROKER_CONNECT_S = 3.0


def parse_gpu_list(value: str | None) -> tuple[int, ...]:
    """`SLURM_JOB_GPUS` / `CUDA_VISIBLE_DEVICES` ("0,2" or "0-1") -> indexes."""
    out: list[int] = []
    for part in (value or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if lo.isdigit() and hi.isdigit():
                out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
    return tuple(out)


def job_gpus(env: Mapping[str, str]) -> tuple[int, ...]:
    return parse_gpu_list(env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES"))


def route_address(target_host: str) -> str:
    """The local address this node uses to reach ``target_host`` (how others reach us)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target_host, 9))
        return str(s.getsockname()[0])


def read_broker_url(broker_file: Path) -> str:
    data = json.loads(broker_file.read_text())
    return str(data["agent_url"])


# A real request per kind of model: generative models must chat, embedding models embed,
# cross-encoders score a pair.
_PROBES: tuple[tuple[str, str], ...] = (
    ("/v1/chat/completions", "choices"),
    ("/v1/embeddings", "data"),
    ("/score", "data"),
)


def _probe_body(path: str, served_model: str) -> dict[str, object]:
    if path == "/v1/embeddings":
        return {"model": served_model, "input": "ping"}
    if path == "/score":
        return {"model": served_model, "text_1": "ping", "text_2": "pong"}
    return {
        "model": served_model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": False,
    }


async def context_length(
    session: aiohttp.ClientSession, base: str, served_model: str, secret: str | None
) -> int | None:
    """The engine's context length as its ``GET /v1/models`` states it (vLLM does), for the
    gateway; None when it does not say (transformers, commands) or does not answer."""
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        async with session.get(f"{base}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json()).get("data")
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, AttributeError):
        return None
    cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
    card = next((c for c in cards if c.get("id") == served_model), cards[0] if cards else None)
    value = card.get("max_model_len") if card is not None else None
    return value if type(value) is int and value > 0 else None


# How often the agent looks for the engine's listening socket (one read of /proc/net/tcp), and
# then how often it tries a real request: engines listen only once the model is loaded, so the
# first request after that usually answers. Every tenth of a second here is launch latency.
LISTEN_POLL_S = 0.1
PROBE_POLL_S = 0.2


async def wait_healthy(
    session: aiohttp.ClientSession,
    base: str,
    served_model: str,
    child: runner.Child,
    deadline_s: float,
    secret: str | None = None,
    *,
    engine_port: int,
) -> None:
    """Ready means a real request succeeded (a chat; for an embedding model an embedding; for
    a cross-encoder a score), not a log line. A model that refuses one (4xx) is asked the next.

    No probe (it carries the secret) before the engine itself listens on ``engine_port``:
    another process holding that port fails the start (xhpc.agent.ports)."""
    end = monotonic() + deadline_s
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    kind = 0
    last = "no answer yet"
    while monotonic() < end:
        if child.returncode is not None:
            raise EngineError(f"engine exited with code {child.returncode} during startup")
        if not await asyncio.to_thread(engine_listens, engine_port, child.pid):
            last = f"the engine does not listen on port {engine_port} yet"
            await asyncio.sleep(LISTEN_POLL_S)
            continue
        path, expect = _PROBES[kind]
        try:
            body = _probe_body(path, served_model)
            async with session.post(f"{base}{path}", json=body, headers=headers) as resp:
                if resp.status == 200:
                    data = await resp.json()
                    if data.get(expect):
                        return
                elif 400 <= resp.status < 500 and resp.status not in (401, 408, 429):
                    kind = (kind + 1) % len(_PROBES)  # not this kind of model: try the other
                last = f"HTTP {resp.status} to {path}"
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
            last = type(err).__name__
        await asyncio.sleep(PROBE_POLL_S)
    raise EngineError(f"engine not healthy after {deadline_s:.0f}s ({last})")


class Agent:
    """One replica's agent: alone in its job, or one of several inside a pilot job (then the
    pilot owns the signals and picks the GPUs, passed in ``env``)."""

    def __init__(
        self, replica_dir: Path, env: Mapping[str, str] | None = None, *, in_pilot: bool = False
    ) -> None:
        self.dir = replica_dir
        self.in_pilot = in_pilot
        self.env = dict(os.environ if env is None else env)
        self.spec = AgentSpec.model_validate_json((replica_dir / SPEC_FILE).read_text())
        self.token = (replica_dir / TOKEN_FILE).read_text().strip()
        secret_file = replica_dir / SECRET_FILE
        self.secret = secret_file.read_text().strip() if secret_file.exists() else None
        self.guard: EngineGuard | None = None
        self.liveness = LivenessPort()  # the gateway's way to tell a lost job from a dead engine
        self.job_id = self.env.get("SLURM_JOB_ID", "0")
        if self.spec.het_offset is not None:
            # A component of a PD unit's hetjob: every component sees the leader's id.
            self.job_id = f"{self.job_id}+{self.spec.het_offset}"
        self.side_channel_port: int | None = None
        self.stop_event = asyncio.Event()
        # Set by the job's SIGTERM (requeued, cancelled, preempted, at its time limit), never by
        # the engine's own exit: the guard then tells a broken engine connection apart from a
        # request that broke the engine (xhpc.agent.guard).
        self.ending = asyncio.Event()
        self.drain_event = asyncio.Event()
        self.restarts = int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)
        self.child: runner.Child | None = None
        self.tmp_dir: Path | None = None  # the engine's private scratch dir, once made
        self.broker_url = read_broker_url(Path(self.spec.broker_file))
        # A replica spanning nodes: this agent's rank (0: the head, which serves and registers).
        self.rank = node_rank(self.env) if self.spec.nodes > 1 else 0
        self.rendezvous = rendezvous_file(self.dir, self.job_id, self.restarts)
        self.started_wall = time.time()
        self.lost_node: str | None = None  # the node of a rank found silent

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", WIRE_HEADER: str(WIRE_VERSION)}

    async def _post(self, session: aiohttp.ClientSession, path: str, payload: str) -> int:
        """The broker's HTTP status (0: unreachable). 410 means this replica is over, or this
        agent belongs to an earlier run of its requeued job: the agent stops its engine."""
        for attempt in range(2):
            try:
                async with session.post(
                    f"{self.broker_url}{path}",
                    data=payload,
                    headers={**self._headers(), "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(
                        total=BROKER_CALL_S, sock_connect=BROKER_CONNECT_S
                    ),
                ) as resp:
                    if resp.status == GONE:
                        log.warning("the broker says replica %s is over: stopping", self.rid)
                        self.stop_event.set()
                    elif resp.status != 200:
                        log.warning("broker answered %d to %s", resp.status, path)
                    return resp.status
            except (aiohttp.ClientError, TimeoutError) as err:
                log.warning("broker unreachable (%s); re-reading its address", type(err).__name__)
                if attempt == 0:
                    # A restarted broker writes a new address file: find it again.
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        self.broker_url = read_broker_url(Path(self.spec.broker_file))
        return 0

    @property
    def rid(self) -> str:
        return self.spec.replica_id

    @property
    def node(self) -> str:
        return self.env.get("SLURMD_NODENAME") or socket.gethostname()

    async def report(
        self,
        session: aiohttp.ClientSession,
        phase: str,
        detail: str = "",
        staged: StagedCopy | None = None,
    ) -> int:
        rep = AgentReport(
            replica_id=self.rid,
            job_id=self.job_id,
            phase=phase,
            detail=detail or None,
            restarts=self.restarts,
            node=self.node if staged is not None else self._failed_on(phase),
            staged=staged,
        )
        return await self._post(session, "/agent/v1/report", rep.model_dump_json())

    def _failed_on(self, phase: str) -> str | None:
        """A failure report's node: the node of a lost rank (a replica across nodes)."""
        return self.lost_node if phase == "failed" else None

    async def stage_weights(self) -> StagedCopy | None:
        """With ``[cache] local_dir``: the weights copied (or found) on this node's disk, and
        the engine pointed at them; without it, or when staging fails, the shared store's."""
        if self.spec.stage_dir is None:
            return None
        source, local = Path(self.spec.model_path), Path(self.spec.stage_dir)
        name, expected = self.spec.weights or self.spec.deployment, self.spec.weights_digest
        try:
            copy = await asyncio.to_thread(stage, source, local, name, expected=expected)
        except (WeightsError, UnsafePathError, OSError) as err:
            log.warning("weights not staged (the engine loads the shared copy): %s", err)
            return None
        log.info("weights %s at %s", "reused" if copy.reused else "staged", copy.path)
        self.spec = self.spec.model_copy(update={"model_path": copy.path})
        return copy

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._terminated)
        # Slurm's warning before the time limit (--signal=B:USR1@N): drain, do not stop.
        loop.add_signal_handler(signal.SIGUSR1, self.drain_event.set)

    def _terminated(self) -> None:
        self.ending.set()
        self.stop_event.set()

    def _make_tmp_dir(self) -> Path:
        """A fresh owner-only (0700) directory under the job's TMPDIR with an unguessable name:
        the engine's working directory and caches. Never a predictable path that another user
        could create first and fill with modules for the engine to import, and never under a
        TMPDIR where another user could swap it for theirs (xhpc.agent.private)."""
        base = Path(self.env.get("TMPDIR") or tempfile.gettempdir())
        prefix = f"xhpc-{self.spec.replica_id}-{self.job_id}-"
        try:
            self.tmp_dir = scratch_dir(base, prefix)
        except OSError as err:
            raise EngineError(f"cannot make a scratch directory under {base}: {err}") from err
        return self.tmp_dir

    async def run(self) -> int:
        """Run the replica; the job's scratch directory is removed however it ends."""
        try:
            return await self._run()
        finally:
            if self.guard is not None:
                await self.guard.stop()
            await self.liveness.stop()
            if self.spec.nodes > 1 and self.rank == 0:
                # The other ranks' sign that the head is gone (xhpc.agent.ranks).
                self.rendezvous.unlink(missing_ok=True)
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)

    async def _run(self) -> int:
        if not self.in_pilot:
            self._install_signals()
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if self.rank > 0:
                return await self._run_member(session)
            await self.report(session, "starting")
            staged = await self.stage_weights()
            if staged is not None:
                await self.report(session, "starting", staged=staged)
            try:
                launch, address, port = await self._start_engine(session)
            except EngineError as err:
                if self.child is not None:
                    await self.child.stop()
                if self.stop_event.is_set():
                    # Stopped (scancel, time limit) while starting: a drain, not a failure.
                    await self.report(session, "stopping", "stopped while starting")
                    return 0
                detail = f"{err.one_line()}; engine log: {self._engine_log_tail()}"
                log.error("%s", detail)
                await self.report(session, "failed", detail[:2000])
                return 1
            context = await context_length(
                session, f"http://127.0.0.1:{port}", launch.served_model, self.secret
            )
            try:
                agent_port: int | None = await self.liveness.start()
            except OSError as err:  # the gateway then treats every break as the engine's
                log.warning("no liveness port: %s", err)
                agent_port = None
            reg = AgentRegistration(
                replica_id=self.spec.replica_id,
                job_id=self.job_id,
                node=self.node,
                host=address,
                port=port,
                gpus=job_gpus(self.env),
                served_model=launch.served_model,
                side_channel_port=self.side_channel_port,
                restarts=self.restarts,
                max_model_len=context,
                agent_port=agent_port,
            )
            await self._post(session, "/agent/v1/register", reg.model_dump_json())
            log.info("replica %s ready at http://%s:%d", self.spec.replica_id, address, port)
            return await self._serve(session, reg)

    def _engine_log_tail(self, lines: int = 3) -> str:
        try:
            text = (self.dir / f"engine-{self.job_id}.log").read_text(errors="replace")
        except OSError:
            return "(none)"
        return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:]) or "(empty)"

    def _address(self) -> str:
        """This node's address: the one it reaches the broker from (others reach it there)."""
        return route_address(urlsplit(self.broker_url).hostname or "127.0.0.1")

    async def _run_member(self, session: aiohttp.ClientSession) -> int:
        """A rank > 0 of a replica spanning nodes: its weights staged on this node, its part of
        the engine started once rank 0 has told where to meet, and kept until the engine or
        the head ends. A non-zero exit ends the whole step (``srun --kill-on-bad-exit``)."""
        alive = asyncio.create_task(self._show_alive())
        try:
            return await self._member(session)
        finally:
            alive.cancel()

    async def _show_alive(self) -> None:
        """A rank > 0's heartbeat to its head, from its start to its end (xhpc.agent.ranks)."""
        path = alive_file(self.rendezvous, self.rank)
        while True:
            with contextlib.suppress(OSError):
                touch_alive(path, self.node)
            await asyncio.sleep(min(1.0, self.spec.heartbeat_interval_s))

    async def _ranks_lost(self) -> str:
        """Returns (why) once another rank of this replica has gone silent, its node kept for
        the failure's report; never without."""
        limit = silence_s(self.spec.heartbeat_interval_s)
        while True:
            silent = silent_ranks(self.rendezvous, self.spec.nodes, self.started_wall, limit)
            if silent:
                node = rank_node(self.rendezvous, silent[0])
                where = f" on {node}" if node else ""
                which = ", ".join(map(str, silent))
                self.lost_node = node
                why = f"rank {which} of {self.spec.nodes}{where} silent for over {limit:g}s"
                return f"{why} (node lost?)"
            await asyncio.sleep(min(1.0, self.spec.heartbeat_interval_s / 2))

    async def _member(self, session: aiohttp.ClientSession) -> int:
        staged = await self.stage_weights()
        if staged is not None:
            await self.report(session, "starting", staged=staged)
        address = self._address()
        try:
            rank = await member_rank(
                self.rank,
                self.spec.nodes,
                address,
                self.rendezvous,
                self.spec.startup_timeout_s,
                self.stop_event,
            )
            if self.stop_event.is_set():
                return 0
            log.info("rank %d of %d: rank 0 at %s", self.rank, self.spec.nodes, rank.master_addr)
            engine = await start_engine(
                self.spec,
                env=self.env,
                secret=None,
                host=address,
                node_address=address,
                tmp_dir=self._make_tmp_dir(),
                output=self.dir / f"engine-{self.job_id}-rank{self.rank}.log",
                rank=rank,
            )
        except EngineError as err:
            log.error("%s", err.one_line())
            return 1
        self.child = engine.child
        child_wait = asyncio.create_task(engine.child.wait())
        while not self.stop_event.is_set():
            if child_wait.done():
                log.error("rank %d: engine exited with code %s", self.rank, child_wait.result())
                await engine.child.stop(grace_s=0)
                return 1
            if not self.rendezvous.exists():
                log.info("rank %d: the head has ended: stopping", self.rank)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(self.stop_event.wait()), self.spec.heartbeat_interval_s
                )
        await engine.child.stop(grace_s=15)
        child_wait.cancel()
        return 0

    async def _start_engine(self, session: aiohttp.ClientSession) -> tuple[EngineLaunch, str, int]:
        address = self._address()
        rank: Rank | None = None
        if self.spec.nodes > 1:
            rank = head_rank(self.spec.nodes, address, self.rendezvous)
        if self.spec.side_channel:
            self.side_channel_port = free_port()
        tmp = self._make_tmp_dir()
        log.info("starting the %s engine", self.spec.engine.value)
        engine = await start_engine(
            self.spec,
            env=self.env,
            secret=self.secret,
            host="0.0.0.0",
            node_address=address,
            tmp_dir=tmp,
            output=self.dir / f"engine-{self.job_id}.log",
            side_channel_port=self.side_channel_port,
            rank=rank,
            ending=self.ending,
        )
        self.child, self.guard = engine.child, engine.guard
        health = asyncio.create_task(
            wait_healthy(
                session,
                f"http://127.0.0.1:{engine.port}",
                engine.launch.served_model,
                self.child,
                self.spec.startup_timeout_s,
                self.secret,
                engine_port=engine.engine_port,
            )
        )
        stop = asyncio.create_task(self.stop_event.wait())
        waits: set[asyncio.Future[Any]] = {health, stop}
        lost = asyncio.create_task(self._ranks_lost()) if self.spec.nodes > 1 else None
        if lost is not None:
            waits.add(lost)
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits - done:
            task.cancel()
        if lost is not None and lost in done:
            raise EngineError(lost.result())
        if health not in done:
            raise EngineError("stopped before the engine became healthy")
        health.result()
        return engine.launch, address, engine.port

    async def _serve(self, session: aiohttp.ClientSession, reg: AgentRegistration) -> int:
        assert self.child is not None
        child_wait = asyncio.create_task(self.child.wait())
        lost = asyncio.create_task(self._ranks_lost()) if self.spec.nodes > 1 else None
        try:
            return await self._serving(session, reg, child_wait, lost)
        finally:
            if lost is not None:
                lost.cancel()

    async def _serving(
        self,
        session: aiohttp.ClientSession,
        reg: AgentRegistration,
        child_wait: asyncio.Task[int],
        lost: asyncio.Task[str] | None,
    ) -> int:
        assert self.child is not None
        code = 0
        draining = False
        while not self.stop_event.is_set():
            if lost is not None and lost.done():
                # The engine cannot answer without that rank: out of rotation now, and the
                # step ends (this agent's bad exit), so the replica is replaced whole.
                log.error("%s", lost.result())
                await self.report(session, "failed", lost.result())
                await self.child.stop(grace_s=0)
                child_wait.cancel()
                return 1
            if child_wait.done():
                log.error("engine exited with code %s", child_wait.result())
                await self.child.stop(grace_s=0)  # what it left behind (an engine's workers)
                await self.report(
                    session, "failed", f"engine exited with code {child_wait.result()}"
                )
                return 1
            if self.drain_event.is_set():
                if not draining:
                    log.info("time limit near: draining (the engine serves in-flight requests)")
                    draining = True
                # Until the broker has it: it then cancels the job once in-flight requests end.
                await self.report(session, "draining", "time limit near")
            elif await self.report(session, "ready") == 409:
                # The broker may have restarted and lost us: register again, replaying our state.
                await self._post(session, "/agent/v1/register", reg.model_dump_json())
            # Until the next heartbeat, a stop, or (across nodes) a lost rank.
            stop_wait = asyncio.ensure_future(self.stop_event.wait())
            waits: set[asyncio.Future[Any]] = {stop_wait}
            if lost is not None:
                waits.add(lost)
            await asyncio.wait(
                waits, timeout=self.spec.heartbeat_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            stop_wait.cancel()
        log.info("stopping the engine")
        await self.report(session, "stopping")
        await self.child.stop(grace_s=15)
        child_wait.cancel()
        return code


async def run_agent(replica_dir: Path) -> int:
    return await Agent(replica_dir).run()
