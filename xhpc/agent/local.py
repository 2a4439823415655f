"""In-allocation serving: an engine on this job's GPUs, answering on this node, no broker.

A pipeline that holds its own allocation (an sbatch script with GPUs, an salloc shell) starts
a model where it runs: ``xhpc.local(...)`` in Python, ``xhpc run-server`` in a script. The
GPUs are picked idle-first over the job's devices as the pilot agent picks them
(``xhpc.agent.slots``); servers of the same user in the same job claim theirs in a private
directory (one file per server, under a lock), so two of them never share a GPU: the directory,
its lock and its claims are checked to be this user's own (``xhpc.agent.private``). Each server
has its own secret: the node and its loopback are shared with other users' jobs, so nothing
answers without it. The engine stops with the context (or the command), and a server whose
process died leaves only a claim that the next one ignores.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import psutil  # type: ignore[import-untyped, unused-ignore]

from xhpc.agent.agent import job_gpus, wait_healthy
from xhpc.agent.launch import RunningEngine, start_engine
from xhpc.agent.pilot import gpu_memory
from xhpc.agent.private import open_private, private_dir, scratch_dir, shared_base
from xhpc.agent.slots import DeviceTable, SlotError, allocate_devices
from xhpc.catalog import agent_spec, engine_word_problems, resolve_model
from xhpc.client.endpoint import Endpoint
from xhpc.engine_config import ModelEngineConfig
from xhpc.engine_schema import engine_config_problems
from xhpc.engine_schemas import read_schema
from xhpc.errors import AdmissionError, EngineError, UnsafePathError, ValidationError
from xhpc.models import AgentSpec, EngineKind
from xhpc.runner import CommandFailed
from xhpc.settings import XhpcConfig

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")


def _tmp_base(env: Mapping[str, str]) -> Path:
    return Path(env.get("TMPDIR") or tempfile.gettempdir())


def claims_dir(env: Mapping[str, str]) -> Path:
    """This user's claims in this job: owner-only; refused (UnsafePathError) when someone else
    made it first, or could swap it (a TMPDIR of theirs, or one open to all and not sticky)."""
    base = shared_base(_tmp_base(env), create=False)
    job = env.get("SLURM_JOB_ID", "nojob")
    if not re.fullmatch(r"[A-Za-z0-9_+]{1,64}", job):
        raise ValidationError(f"SLURM_JOB_ID {job!r} is not a job id")
    return private_dir(base / f"xhpc-local-{os.geteuid()}-{job}")


def _read_claim(path: Path) -> dict[str, Any]:
    """A claim file of ours (never through a link), parsed; OSError or ValueError otherwise."""
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as fh:
        data = json.loads(fh.read(4096))
    if not isinstance(data, dict):
        raise ValueError("not a claim")
    return data


def _write_claim(path: Path, claim: dict[str, Any]) -> None:
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(claim))


def node_address() -> str:
    """How other processes reach this node: its hostname where that resolves to an address
    that is not loopback (the cluster's DNS or hosts file), else its first such IPv4 address."""
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        if not socket.gethostbyname(name).startswith("127."):
            return name
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return str(addr.address)
    return "127.0.0.1"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = open_private(directory / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _held(directory: Path) -> dict[str, tuple[int, ...]]:
    """The GPUs of the claims whose process still runs."""
    held: dict[str, tuple[int, ...]] = {}
    for claim in directory.glob("*.json"):  # a file that is not ours is no claim
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, UnsafePathError):
            data = _read_claim(claim)
            if _alive(int(data["pid"])):
                held[claim.stem] = tuple(int(g) for g in data["gpus"])
    return held


def claim_gpus(count: int, env: Mapping[str, str], owner: str) -> tuple[int, ...]:
    """``count`` of the job's GPUs for ``owner``, idle-first, or AdmissionError."""
    devices = job_gpus(env)
    if count == 0:
        return ()
    if not devices:
        raise AdmissionError(
            [f"this job holds no GPUs and the model asks for {count}"],
            hint="submit the job with --gres=gpu:N (or --gpus N), or pass gpus=0 on a CPU node",
        )
    directory = claims_dir(env)
    with _locked(directory):
        table = DeviceTable(devices=devices, held=_held(directory), mem_used_mb=gpu_memory(devices))
        try:
            gpus = allocate_devices(table, owner, count)
        except SlotError as err:
            raise AdmissionError([str(err)]) from err
        _write_claim(directory / f"{owner}.json", {"pid": os.getpid(), "gpus": list(gpus)})
    return gpus


def release_gpus(env: Mapping[str, str], owner: str) -> None:
    with contextlib.suppress(OSError, ValidationError, UnsafePathError):
        (claims_dir(env) / f"{owner}.json").unlink(missing_ok=True)


def visible_devices(gpus: tuple[int, ...], env: Mapping[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for ``gpus`` (the job's indexes): where Slurm constrains devices
    the job sees its GPUs renumbered from 0, in SLURM_JOB_GPUS's order."""
    job = job_gpus(env)
    shown = [p.strip() for p in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
    if len(shown) == len(job):
        return ",".join(shown[job.index(g)] for g in gpus)
    return ",".join(str(g) for g in gpus)


class LocalEngine:
    """One engine in this job (asyncio): ``start`` returns once a real request succeeded."""

    def __init__(
        self,
        spec: AgentSpec,
        *,
        gpus: int,
        host: str,
        port: int | None,
        env: Mapping[str, str] | None = None,
        log_file: Path | None = None,
        engine_config: ModelEngineConfig | None = None,
    ) -> None:
        self.spec = spec
        self.engine_config = engine_config  # already in the spec's args: checked at start
        self.count = gpus
        self.host = host
        self.port = port
        self.env = dict(os.environ if env is None else env)
        self.log_file = log_file
        self.secret = secrets.token_urlsafe(32)
        self.owner = f"{spec.replica_id}-{secrets.token_hex(4)}"
        self.gpus: tuple[int, ...] = ()
        self.engine: RunningEngine | None = None
        self.tmp_dir: Path | None = None

    @property
    def url(self) -> str:
        """Where the engine answers, as other processes of the job reach it."""
        assert self.engine is not None, "not started"
        host = node_address() if self.host in WILDCARDS else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.engine.port}"

    @property
    def served_model(self) -> str:
        assert self.engine is not None, "not started"
        return self.engine.launch.served_model

    def log_tail(self, lines: int = 5) -> str:
        path = self.log_file or (self.tmp_dir / "engine.log" if self.tmp_dir else None)
        try:
            text = path.read_text(errors="replace") if path else ""
        except OSError:
            return "(none)"
        return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:]) or "(empty)"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _check_engine_config(self) -> None:
        """The model's engine configuration against the engine's own options, as admission
        checks it (an unreadable schema leaves the types' check alone)."""
        if self.engine_config is None:
            return
        try:
            schema = await read_schema(self.spec.python or "python3")
        except (CommandFailed, ValueError) as err:
            log.warning("cannot read the engine's options (%s): engine_config unchecked", err)
            schema = None
        problems = engine_config_problems(
            self.engine_config, self.spec.engine, self.spec.model_path, schema
        )
        if problems:
            raise AdmissionError(problems)

    async def _start(self) -> None:
        await self._check_engine_config()
        self.gpus = claim_gpus(self.count, self.env, self.owner)
        env = dict(self.env)
        if self.gpus:
            env.update(
                CUDA_VISIBLE_DEVICES=visible_devices(self.gpus, self.env),
                SLURM_JOB_GPUS=",".join(str(g) for g in self.gpus),
            )
        self.tmp_dir = scratch_dir(_tmp_base(self.env), "xhpc-local-engine-")
        probe_host = "127.0.0.1" if self.host in (*WILDCARDS, "localhost") else self.host
        self.engine = await start_engine(
            self.spec,
            env=env,
            secret=self.secret,
            host=self.host or "0.0.0.0",
            node_address=probe_host,
            tmp_dir=self.tmp_dir,
            output=self.log_file or self.tmp_dir / "engine.log",
            port=self.port,
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            try:
                await wait_healthy(
                    session,
                    f"http://{probe_host}:{self.engine.port}",
                    self.engine.launch.served_model,
                    self.engine.child,
                    self.spec.startup_timeout_s,
                    self.secret,
                    engine_port=self.engine.engine_port,
                )
            except EngineError as err:
                raise EngineError(f"{err}; engine log: {self.log_tail()}") from err

    async def stop(self) -> None:
        try:
            if self.engine is not None:
                await self.engine.stop()
        finally:
            release_gpus(self.env, self.owner)
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)

    async def wait(self) -> int:
        """Until the engine exits by itself (its return code)."""
        assert self.engine is not None, "not started"
        return await self.engine.child.wait()


def local_engine(
    model: str,
    config: XhpcConfig,
    *,
    gpus: int = 1,
    engine: str | EngineKind | None = None,
    engine_args: tuple[str, ...] = (),
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    log_file: Path | None = None,
    engine_config: ModelEngineConfig | None = None,
) -> LocalEngine:
    """A LocalEngine for ``model`` (a catalog name or a model directory), not yet started.
    ``engine_config``: how the engine serves it (None: the site catalog entry's, if any)."""
    if gpus < 0:
        raise ValidationError(f"gpus must be 0 or more, not {gpus}")
    if port is not None and not 0 < port < 65536:
        raise ValidationError(f"port {port} is not a TCP port")
    odd = engine_word_problems(engine_args)
    if odd:
        raise ValidationError("; ".join(odd))
    try:
        kind = EngineKind(engine) if engine is not None else None
    except ValueError as err:
        known = ", ".join(k.value for k in EngineKind)
        raise ValidationError(f"unknown engine {engine!r}", hint=f"engines: {known}") from err
    resolved = resolve_model(model, config, name)
    kind = kind or resolved.engine or config.default_engine
    entry = config.models.get(model)
    if engine_config is None and entry is not None:
        engine_config = entry.engine_config
    odd = engine_config_problems(engine_config, kind, str(resolved.path), None)
    if odd:
        raise ValidationError("; ".join(odd))
    spec = agent_spec(
        f"local-{os.getpid()}",
        resolved,
        kind,
        config,
        args=engine_args,
        engine_config=engine_config,
    )
    if timeout_s is not None:
        spec = spec.model_copy(update={"startup_timeout_s": timeout_s})
    return LocalEngine(
        spec,
        gpus=gpus,
        host=host,
        port=port,
        env=env,
        log_file=log_file,
        engine_config=engine_config,
    )


class LocalServer(Endpoint):
    """``LocalEngine`` for code that is not asyncio: the engine lives on an event loop in a
    thread of its own. A context manager: leaving the block stops the engine."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.base_url = ""
        self.api_key = engine.secret

    def __repr__(self) -> str:
        return f"LocalServer(base_url={self.base_url!r}, gpus={self.gpus})"

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.engine.gpus

    @property
    def model(self) -> str:
        """The name the engine serves the model under (what requests pass as ``model``)."""
        return self.engine.served_model

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def start(self) -> LocalServer:
        self._thread.start()
        try:
            self._call(self.engine.start())
        except BaseException:
            self._close()
            raise
        self.base_url = f"{self.engine.url}/v1"
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self.engine.stop())
        finally:
            self._close()

    def _close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
