"""The pilot agent: one job holds GPUs on a node and runs several replicas inside it.

It heartbeats to the broker with the devices its job can see and what runs on them; the
broker answers with the replicas that should run and those to stop. Each replica runs as an
in-process `Agent` (its own token, reports and engine) on the GPUs this agent picks from its
own device table (xhpc.agent.slots): the pilot is authoritative inside its allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from xhpc import nvml
from xhpc.agent.agent import (
    BROKER_CALL_S,
    BROKER_CONNECT_S,
    TOKEN_FILE,
    Agent,
    job_gpus,
    read_broker_url,
)
from xhpc.agent.slots import DeviceTable, SlotError, allocate_devices
from xhpc.errors import XhpcError
from xhpc.models import PilotAssignment, PilotOrders, PilotReport, PilotSpec
from xhpc.wire import WIRE_HEADER, WIRE_VERSION, read_json

log = logging.getLogger(__name__)

SPEC_FILE = "pilot.json"
STOP_GRACE_S = 30.0


def gpu_memory(devices: tuple[int, ...]) -> dict[int, float]:
    """Memory in use per visible GPU when NVML answers (an idle-first tie-break), else {}."""
    if not devices:
        return {}
    try:
        rows = nvml.read_gpus()
    except (XhpcError, OSError):
        return {}
    by_index = {r.index: r.mem_used_mb for r in rows if r.mem_used_mb is not None}
    return {g: by_index[g] for g in devices if g in by_index}


class PilotAgent:
    def __init__(self, pilot_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.dir = pilot_dir
        self.env = dict(os.environ if env is None else env)
        self.spec = PilotSpec.model_validate_json((pilot_dir / SPEC_FILE).read_text())
        self.token = (pilot_dir / TOKEN_FILE).read_text().strip()
        self.job_id = self.env.get("SLURM_JOB_ID", "0")
        devices = job_gpus(self.env)
        self.table = DeviceTable(devices=devices, mem_used_mb=gpu_memory(devices))
        self.agents: dict[str, Agent] = {}
        self.tasks: dict[str, asyncio.Task[int]] = {}
        self.refused: set[str] = set()
        self.stop_event = asyncio.Event()
        self.broker_url = read_broker_url(Path(self.spec.broker_file))

    def report(self) -> PilotReport:
        return PilotReport(
            pilot_id=self.spec.pilot_id,
            job_id=self.job_id,
            node=self.env.get("SLURMD_NODENAME") or self.spec.node,
            devices=self.table.devices,
            running=dict(self.table.held),
        )

    async def heartbeat(self, session: aiohttp.ClientSession) -> PilotOrders | None:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Content-Type": "application/json",
            WIRE_HEADER: str(WIRE_VERSION),
        }
        try:
            async with session.post(
                f"{self.broker_url}/agent/v1/pilot",
                data=self.report().model_dump_json(),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=BROKER_CALL_S, sock_connect=BROKER_CONNECT_S),
            ) as resp:
                if resp.status != 200:
                    log.warning("broker answered %d to the pilot heartbeat", resp.status)
                    return None
                return read_json(PilotOrders, await resp.read())
        except (aiohttp.ClientError, TimeoutError) as err:
            log.warning("broker unreachable (%s); re-reading its address", type(err).__name__)
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.broker_url = read_broker_url(Path(self.spec.broker_file))
            return None

    async def apply(self, session: aiohttp.ClientSession, orders: PilotOrders) -> None:
        for rid in orders.stop:
            agent = self.agents.get(rid)
            if agent is not None and not agent.stop_event.is_set():
                log.info("stopping replica %s", rid)
                agent.stop_event.set()
        new = [
            a
            for a in orders.run
            if a.replica_id not in self.agents and a.replica_id not in self.refused
        ]
        # Pinned replicas first: their GPUs are not negotiable, the others' are.
        for a in sorted(new, key=lambda a: (not a.gpu_idx, a.replica_id)):
            await self._start(session, a)

    async def _start(self, session: aiohttp.ClientSession, a: PilotAssignment) -> None:
        try:
            agent = Agent(Path(a.replica_dir), env=self.env, in_pilot=True)
        except (OSError, ValueError) as err:
            log.error("cannot read replica %s: %s", a.replica_id, err)
            self.refused.add(a.replica_id)
            return
        try:
            gpus = allocate_devices(
                self.table, a.replica_id, a.gpus, a.gpu_idx, sharing=self.spec.gpu_sharing
            )
        except SlotError as err:
            log.warning("%s", err)
            self.refused.add(a.replica_id)
            await agent.report(session, "failed", str(err))
            return
        self.table = self.table.with_held(a.replica_id, gpus)
        shown = ",".join(str(g) for g in gpus)
        agent.env.update(CUDA_VISIBLE_DEVICES=shown, SLURM_JOB_GPUS=shown)
        log.info("replica %s gets GPU(s) %s", a.replica_id, shown)
        self.agents[a.replica_id] = agent
        self.tasks[a.replica_id] = asyncio.create_task(agent.run())

    async def reap(self, session: aiohttp.ClientSession) -> None:
        """Free the GPUs of replicas whose agent ended; a clean end is reported as stopped."""
        for rid, task in list(self.tasks.items()):
            if not task.done():
                continue
            del self.tasks[rid]
            agent = self.agents.pop(rid)
            self.table = self.table.without(rid)
            code = 1 if task.cancelled() or task.exception() else task.result()
            if code == 0:
                await agent.report(session, "stopped")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        log.info("pilot %s holds GPU(s) %s", self.spec.pilot_id, self.table.devices)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while not self.stop_event.is_set():
                orders = await self.heartbeat(session)
                if orders is not None:
                    await self.apply(session, orders)
                await self.reap(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(self.stop_event.wait()), self.spec.poll_interval_s
                    )
            log.info("pilot stopping: %d replica(s)", len(self.agents))
            for agent in self.agents.values():
                agent.stop_event.set()
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()), timeout=STOP_GRACE_S)
            await self.reap(session)
        return 0


async def run_pilot(pilot_dir: Path) -> int:
    return await PilotAgent(pilot_dir).run()
