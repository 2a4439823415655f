"""The probe daemon: sample the node every interval and POST the report to the broker's agent API.

The broker's address is read from its address file (JSON ``{"agent_url": ...}``), and read again
after every failed report: a restarted broker writes a new one. Each report carries the node token
as ``Authorization: Bearer …`` (the token is never logged; it is read again after a 401/403, in case
it was rotated). An outage is logged once when it starts and once when it ends; reports are
retried at the normal cadence meanwhile. SIGTERM and SIGINT stop the loop cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import aiohttp

from xhpc.aio import stop_on_signals
from xhpc.clock import monotonic
from xhpc.errors import BrokerUnavailableError, ConfigError
from xhpc.models import ProbeReport
from xhpc.probe.backends import GpuBackend
from xhpc.probe.sample import HostSampler, sample
from xhpc.wire import WIRE_HEADER, WIRE_VERSION

log = logging.getLogger(__name__)

PROBE_PATH = "/agent/v1/probe"


def read_token(token_file: Path) -> str:
    """The node token; `ConfigError` (naming the file, never the content) when unusable."""
    try:
        token = token_file.read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the node token file {token_file}: {err.strerror}") from err
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"the node token file {token_file} holds no single token")
    return token


def read_agent_url(broker_file: Path) -> str | None:
    """The broker's agent URL from its address file; None while there is no usable file."""
    try:
        url = json.loads(broker_file.read_text())["agent_url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url.rstrip("/") if isinstance(url, str) and url.startswith("http") else None


class Reporter:
    """Posts reports; knows whether the broker is in an outage and logs each outage once."""

    def __init__(self, broker_file: Path, token_file: Path, interval_s: float) -> None:
        self.broker_file = broker_file
        self.token_file = token_file
        self.interval_s = interval_s
        # The broker makes the token when it first starts: a probe started before it waits.
        self.token: str | None = None
        with contextlib.suppress(ConfigError):
            self.token = read_token(token_file)
        self.url: str | None = None
        self.failures = 0  # failed reports in the current outage
        self.problem: str | None = None  # why the last report failed

    async def post(self, session: aiohttp.ClientSession, report: ProbeReport) -> bool:
        if self.token is None:
            self._reread_token()
            if self.token is None:
                return self._failed(f"no node token in {self.token_file} yet")
        if self.url is None:
            self.url = read_agent_url(self.broker_file)
        if self.url is None:
            return self._failed(f"no broker address in {self.broker_file}")
        target = f"{self.url}{PROBE_PATH}"
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Content-Type": "application/json",
            WIRE_HEADER: str(WIRE_VERSION),
        }
        try:
            async with session.post(target, data=report.model_dump_json(), headers=headers) as resp:
                if 200 <= resp.status < 300:
                    return self._ok()
                problem = f"{target} answered HTTP {resp.status}"
                if resp.status in (401, 403):
                    self._reread_token()
        except (aiohttp.ClientError, TimeoutError) as err:
            problem = f"{target} unreachable ({type(err).__name__})"
        # The broker may have restarted elsewhere: read its address file again next time.
        self.url = None
        return self._failed(problem)

    def _reread_token(self) -> None:
        with contextlib.suppress(ConfigError):
            self.token = read_token(self.token_file)

    def _ok(self) -> bool:
        if self.failures:
            log.info("broker reachable again after %d failed report(s)", self.failures)
        self.failures = 0
        self.problem = None
        return True

    def _failed(self, problem: str) -> bool:
        if not self.failures:
            log.warning(
                "cannot report to the broker: %s; retrying every %gs", problem, self.interval_s
            )
        else:
            log.debug("report failed again: %s", problem)
        self.failures += 1
        self.problem = problem
        return False


async def run_probe(
    node: str,
    backend: GpuBackend,
    broker_file: Path,
    token_file: Path,
    interval_s: float,
    once: bool = False,
    *,
    stop: asyncio.Event | None = None,
    timeout_s: float = 10.0,
    host: HostSampler | None = None,
) -> int:
    """Report every ``interval_s`` until SIGTERM/SIGINT or ``stop``; returns the reports delivered.

    With ``once``, one report: `BrokerUnavailableError` if the broker did not take it.
    """
    stop = stop if stop is not None else asyncio.Event()
    reporter = Reporter(broker_file, token_file, interval_s)
    delivered = 0
    with stop_on_signals(stop):
        host = host if host is not None else HostSampler()
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                started = monotonic()
                report = await asyncio.to_thread(sample, node, backend, host)
                if await reporter.post(session, report):
                    delivered += 1
                if once:
                    break
                delay = max(0.0, interval_s - (monotonic() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
    if once and not delivered:
        raise BrokerUnavailableError(
            f"the probe report was not delivered: {reporter.problem}",
            hint="is the broker running (xhpc broker)?",
        )
    return delivered
