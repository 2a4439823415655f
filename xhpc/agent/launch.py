"""Starting an engine process: its ports, its guard, its command, its output file.

Shared by the replica agent (a broker's job) and in-allocation serving (``xhpc.local``, no
broker). An engine that cannot check a secret itself (see ``checks_keys``) listens on loopback
behind an ``EngineGuard`` that does; the secret reaches the engine through its environment,
never its argv.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from xhpc import runner
from xhpc.agent.engines import EngineLaunch, Rank, checks_keys, engine_launch
from xhpc.agent.guard import EngineGuard
from xhpc.agent.ports import free_port
from xhpc.catalog import engine_env_hint
from xhpc.errors import EngineError
from xhpc.models import AgentSpec


@dataclass
class RunningEngine:
    launch: EngineLaunch
    child: runner.Child
    port: int  # where clients call it: the guard's port, or the engine's own
    engine_port: int  # where the engine itself listens
    guard: EngineGuard | None

    async def stop(self, grace_s: float = 15.0) -> None:
        try:
            await self.child.stop(grace_s=grace_s)
        finally:
            if self.guard is not None:
                await self.guard.stop()


async def start_engine(
    spec: AgentSpec,
    *,
    env: Mapping[str, str],
    secret: str | None,
    host: str,
    node_address: str,
    tmp_dir: Path,
    output: Path,
    port: int | None = None,
    side_channel_port: int | None = None,
    rank: Rank | None = None,
    ending: asyncio.Event | None = None,
) -> RunningEngine:
    """Start the engine of ``spec`` answering on ``host``:``port`` (a free one when None).
    Ready is the caller's to learn (``wait_healthy``): this returns once the process runs.
    ``ending``: set when the job ends (its guard then lets the gateway retry elsewhere)."""
    port = free_port() if port is None else port
    guarded = secret is not None and not checks_keys(spec.engine)
    engine_port = free_port() if guarded else port
    launch = engine_launch(
        spec,
        host="127.0.0.1" if guarded else host,
        port=engine_port,
        node_address=node_address,
        tmp_dir=tmp_dir,
        job_env=env,
        api_key=secret,
        side_channel_port=side_channel_port,
        rank=rank,
    )
    guard = None
    if guarded:
        assert secret is not None
        guard = EngineGuard(secret, f"http://127.0.0.1:{engine_port}", ending=ending)
        try:
            await guard.start(host, port)
        except OSError as err:
            raise EngineError(f"cannot listen on port {port}: {err}") from err
    try:
        # In a job step (a PD unit's component) Slurm signals every process of the step:
        # the time limit's warning (USR1) is the agent's to act on (a drain), and would
        # kill an engine that has no handler for it.
        child = await runner.spawn(
            launch.argv,
            env=launch.env,
            output=output,
            cwd=tmp_dir,
            block_signals=(signal.SIGUSR1,),
        )
    except OSError as err:
        if guard is not None:
            await guard.stop()
        # the engine's own environment was never made (its Python, or the CLI beside it)
        gone = isinstance(err, FileNotFoundError) and spec.python and not Path(spec.python).exists()
        hint = engine_env_hint(spec.engine.value) if gone else None
        raise EngineError(f"cannot start the engine {launch.argv[0]}: {err}", hint=hint) from err
    return RunningEngine(launch, child, port, engine_port, guard)
