"""Run every site check of `xhpc doctor --site`, each under its own timeout, all at once.

Slurm is asked through the Slurm client, engines' Pythons through the runner; the checks that
only a compute node can answer share one short job (``xhpc.sitecheck.node``, submitted with
``sbatch`` and followed with ``squeue``, cancelled at its timeout). No broker is needed: with
none running, the command listens on the agent API's configured address itself for the job to
reach (docs/decisions/0023-site-doctor-runs-without-a-broker.md). A check that raises or times
out is a ``fail`` row of its own; the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate
from pathlib import Path
from urllib.parse import urlsplit

from xhpc import runner
from xhpc.catalog import engine_env_hint, resolve_model
from xhpc.engine_schema import engine_config_problems
from xhpc.engine_schemas import SCHEMA_TIMEOUT_S, read_schema
from xhpc.models import EngineKind
from xhpc.paths import broker_file_path
from xhpc.settings import XhpcConfig
from xhpc.sitecheck.verdicts import (
    ENGINE_PACKAGES,
    NODE_CHECKS,
    EngineSeen,
    NodeWindow,
    SiteCheck,
    Verdict,
    accounting_check,
    engine_check,
    engine_config_check,
    engine_probe_code,
    fail,
    gres_check,
    node_checks,
    node_job_script,
    parse_node_report,
    partition_check,
    slurm_check,
)
from xhpc.slurm.client import CliSlurmClient

CHECK_TIMEOUT_S = 60.0  # each check on the login node
JOB_TIMEOUT_S = 120.0  # the node job: queued, run and read back within this
POLL_S = 0.5
OUTPUT_GRACE_S = 5.0  # an ended job's output may show on a network filesystem a little later
# Slurm states of a job that may still run or is running
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)


async def _guarded(
    names: Sequence[str], check: Awaitable[list[SiteCheck]], timeout_s: float
) -> list[SiteCheck]:
    """The check's rows; its timeout or any error: a ``fail`` row for each of ``names``."""
    try:
        return await asyncio.wait_for(check, timeout_s)
    except TimeoutError:
        why = f"timed out after {timeout_s:g} s"
    except Exception as err:  # one broken check never hides the others
        why = str(err) or type(err).__name__
    return [fail(name, why) for name in names]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


async def check_slurm(slurm: CliSlurmClient) -> list[SiteCheck]:
    version = await slurm.version()
    try:
        await slurm.nodes_json()
    except Exception as err:
        return [slurm_check(version, _first_line(err))]
    return [slurm_check(version, None)]


async def check_gres(slurm: CliSlurmClient) -> list[SiteCheck]:
    return [gres_check(await slurm.nodes(), slurm.config.partition)]


async def check_partitions(slurm: CliSlurmClient) -> list[SiteCheck]:
    parts = await slurm.partitions()
    return [partition_check(parts, slurm.config.partition, slurm.config.default_time)]


async def check_accounting(slurm: CliSlurmClient) -> list[SiteCheck]:
    config = await slurm.config_values()
    kind = config.get("AccountingStorageType")
    error: str | None = None
    if kind and "slurmdbd" in kind.lower():
        try:
            await slurm.accounting_ping()
        except Exception as err:
            error = _first_line(err)
    return [accounting_check(kind, config.get("ClusterName"), error)]


def engines_to_check(config: XhpcConfig) -> list[EngineKind]:
    """The engines the site configures, and its default engine."""
    kinds = set(config.engines) | {config.default_engine}
    return sorted(kinds, key=lambda k: k.value)


async def check_engine(config: XhpcConfig, engine: EngineKind, timeout_s: float) -> SiteCheck:
    ecfg = config.engine(engine)
    hint = engine_env_hint(engine.value)
    if engine.value not in ENGINE_PACKAGES:
        program = ecfg.command[0] if ecfg.command else ""
        if not program:
            seen = EngineSeen(
                engine=engine.value, python="", found=False, error="no command configured"
            )
        elif shutil.which(program) is None:
            why = f"command {program} not found"
            seen = EngineSeen(engine=engine.value, python=program, found=False, error=why)
        else:
            seen = EngineSeen(engine=engine.value, python=program, found=True)
        return engine_check(seen, hint)
    python = str(ecfg.python) if ecfg.python is not None else "python3"
    found = ecfg.python.exists() if ecfg.python is not None else shutil.which(python) is not None
    if not found:
        return engine_check(EngineSeen(engine=engine.value, python=python, found=False), hint)
    argv = [python, "-c", engine_probe_code(engine.value)]
    try:
        done = await runner.run(argv, timeout_s=timeout_s)
    except runner.CommandFailed as err:
        last = (err.stderr.strip().splitlines() or [err.why])[-1]
        seen = EngineSeen(engine=engine.value, python=python, found=True, error=last)
        return engine_check(seen, hint)
    version = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "?"
    seen = EngineSeen(engine=engine.value, python=python, found=True, version=version)
    return engine_check(seen, hint)


async def check_engine_configs(config: XhpcConfig, timeout_s: float) -> list[SiteCheck]:
    """The catalog's models with an engine configuration: each fits the installed vLLM's own
    options (read from it), and its chat template is in its weights' directory."""
    configured = {
        name: entry.engine_config
        for name, entry in config.models.items()
        if entry.engine_config is not None
    }
    if not configured:
        return []
    ecfg = config.engine(EngineKind.VLLM)
    schema_error: str | None = None
    schema = None
    try:
        schema = await read_schema(str(ecfg.python or "python3"), timeout_s)
    except (runner.CommandFailed, ValueError) as err:
        schema_error = getattr(err, "why", None) or str(err)
    problems: dict[str, list[str]] = {}
    for name, cfg in sorted(configured.items()):
        weights = str(resolve_model(name, config).path)
        problems[name] = engine_config_problems(cfg, EngineKind.VLLM, weights, schema)
    return [engine_config_check(problems, schema_error)]


# ---- the node job ---------------------------------------------------------------------------


def _advertised(config: XhpcConfig) -> str:
    """The address jobs reach the agent API at, as the broker advertises it."""
    b = config.broker
    if b.advertise_host:
        return b.advertise_host
    if b.agent_bind not in ("0.0.0.0", ""):
        return b.agent_bind
    return socket.getfqdn()


async def _reachable(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What the stand-in agent port answers: a bodiless 404 with the login node's Date."""
    with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        head = f"HTTP/1.0 404 Not Found\r\nDate: {formatdate(usegmt=True)}\r\n"
        writer.write((head + "Content-Length: 0\r\n\r\n").encode())
        await writer.drain()
    writer.close()


async def agent_target(config: XhpcConfig) -> tuple[str, str, asyncio.Server | None]:
    """(HOST:PORT, what it is, the stand-in listener or None): the running broker's agent API
    (from its broker.json, when it answers here), else a listener of this command's own on
    ``[broker] agent_bind`` and ``agent_port`` (any free port when that is 0 or taken)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        url = urlsplit(str(json.loads(broker_file_path(config).read_text())["agent_url"]))
        if url.hostname and url.port and await _reachable(url.hostname, url.port):
            return f"{url.hostname}:{url.port}", "the broker's agent API", None
    bind, port = config.broker.agent_bind, config.broker.agent_port
    try:
        server = await asyncio.start_server(_answer, bind, port)
    except OSError:
        server = await asyncio.start_server(_answer, bind, 0)
    bound = server.sockets[0].getsockname()[1]
    what = f"the agent port on {bind} (no broker running: xhpc doctor listened there)"
    return f"{_advertised(config)}:{bound}", what, server


async def _wait_for_report(
    slurm: CliSlurmClient, job_id: str, output: Path, timeout_s: float
) -> tuple[str, str | None, bool]:
    """(the job's last state, its pending reason, whether it is over) once its report is in,
    it ended, or ``timeout_s`` passed (then it is cancelled)."""
    deadline = time.monotonic() + timeout_s
    state, reason = "PENDING", None
    while time.monotonic() < deadline:
        if output.exists() and parse_node_report(output.read_text(errors="replace")):
            return state, reason, True
        jobs = await slurm.jobs([job_id])
        if not jobs:
            return "GONE", None, True
        state, reason = jobs[0].state, jobs[0].reason
        if state not in ACTIVE_STATES:
            ended = time.monotonic() + OUTPUT_GRACE_S
            while time.monotonic() < ended and not output.exists():
                await asyncio.sleep(POLL_S)
            return state, reason, True
        await asyncio.sleep(POLL_S)
    with contextlib.suppress(Exception):
        await slurm.cancel([job_id])
    return state, reason, False


async def check_node(
    config: XhpcConfig, slurm: CliSlurmClient, timeout_s: float, python: str = sys.executable
) -> list[SiteCheck]:
    state_dir = config.resolved_state_dir
    target, label, listener = await agent_target(config)
    work = state_dir / "doctor" / uuid.uuid4().hex[:12]
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # as the broker makes it
        work.mkdir(parents=True, mode=0o700)
        output = work / "node.out"
        script = work / "check.sbatch"
        script.write_text(
            node_job_script(
                python=python,
                output=output,
                partition=config.slurm.partition,
                account=config.slurm.account,
                connect=target,
                paths=[str(state_dir)],
            )
        )
        script.chmod(0o600)
        submitted = time.time()
        job_id = await slurm.submit(script)
        state, reason, over = await _wait_for_report(slurm, job_id, output, timeout_s)
        window = NodeWindow(submitted_s=submitted, read_s=time.time())
        text = output.read_text(errors="replace") if output.exists() else None
        report = parse_node_report(text) if text is not None else None
        rows = functools.partial(
            node_checks, target_label=label, state_dir=str(state_dir), window=window
        )
        if report is not None:
            return rows(report, why_none="")
        if not over:
            why = f"job {job_id} still {state} ({reason or 'no reason'}) after {timeout_s:.0f} s"
            return rows(None, why_none=why, none_verdict=Verdict.WARN)
        if text is None:
            why = f"job {job_id} ended {state} and its output {output} never came"
            return rows(None, why_none=why, state_dir_suspect=True)
        last = (text.strip().splitlines() or ["no output"])[-1]
        why = (
            f"job {job_id} ended {state} with no report ({last}); jobs run xhpc with {python}: "
            "the compute nodes must see it"
        )
        return rows(None, why_none=why)
    finally:
        if listener is not None:
            listener.close()
        shutil.rmtree(work, ignore_errors=True)


async def run_site_checks(
    config: XhpcConfig,
    *,
    timeout_s: float = CHECK_TIMEOUT_S,
    job_timeout_s: float = JOB_TIMEOUT_S,
    slurm: CliSlurmClient | None = None,
) -> list[SiteCheck]:
    """Every check, concurrently; the rows in a fixed order."""
    client = slurm or CliSlurmClient(config.slurm)

    def one(
        name: str, check: Callable[[CliSlurmClient], Awaitable[list[SiteCheck]]]
    ) -> Awaitable[list[SiteCheck]]:
        return _guarded([name], check(client), timeout_s)

    async def engine(kind: EngineKind) -> list[SiteCheck]:
        return [await check_engine(config, kind, timeout_s)]

    runs = [
        one("slurm", check_slurm),
        one("gres", check_gres),
        one("partition", check_partitions),
        one("accounting", check_accounting),
        *(
            _guarded([f"engine:{k.value}"], engine(k), timeout_s + 5)
            for k in engines_to_check(config)
        ),
        _guarded(NODE_CHECKS, check_node(config, client, job_timeout_s), job_timeout_s + 30),
    ]
    if any(e.engine_config is not None for e in config.models.values()):
        runs.append(
            _guarded(
                ["models:engine_config"],
                check_engine_configs(config, SCHEMA_TIMEOUT_S),
                SCHEMA_TIMEOUT_S + 5,
            )
        )
    rows = await asyncio.gather(*runs)
    return [row for group in rows for row in group]
