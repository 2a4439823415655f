"""The installed engines' argument schemas, read from the engines themselves (an adapter: it
runs the engine's Python through the runner) and kept for a while: importing vLLM takes many
seconds, and an engine changes only when the site reinstalls it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import ValidationError

from xhpc import runner
from xhpc.engine_config import ModelEngineConfig
from xhpc.engine_schema import SCHEMA_SCRIPT, EngineSchema, engine_config_problems
from xhpc.models import EngineKind
from xhpc.settings import EngineConfig, XhpcConfig

log = logging.getLogger(__name__)

SCHEMA_TIMEOUT_S = 90.0  # importing vLLM on a busy login node (within a client's 120 s wait)
SCHEMA_MAX_AGE_S = 3600.0


async def read_schema(python: str, timeout_s: float = SCHEMA_TIMEOUT_S) -> EngineSchema:
    """The schema of the vLLM installed for ``python`` (runner.CommandFailed, ValueError)."""
    done = await runner.run(
        [python, "-I", "-c", SCHEMA_SCRIPT],
        timeout_s=timeout_s,
        env={"PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    )
    try:
        return EngineSchema.from_output(done.stdout)
    except ValidationError as err:
        raise ValueError(f"{python}: no schema in its output ({err.error_count()} errors)") from err


class EngineSchemas:
    """Each engine's schema, read on first use and again after ``max_age_s``; None where the
    engine has none to read (not vLLM) or reading it failed (the reason is logged, and kept in
    ``failures`` for `doctor`)."""

    def __init__(self, max_age_s: float = SCHEMA_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._cache: dict[str, tuple[float, EngineSchema | None]] = {}
        self.failures: dict[str, str] = {}
        self._lock = asyncio.Lock()  # one read at a time: a second caller gets the first's

    async def get(self, engine: EngineKind, settings: EngineConfig) -> EngineSchema | None:
        if engine is not EngineKind.VLLM:
            return None
        python = str(settings.python) if settings.python else "python3"
        async with self._lock:
            return await self._get(python)

    async def _get(self, python: str) -> EngineSchema | None:
        hit = self._cache.get(python)
        if hit is not None and time.monotonic() - hit[0] < self.max_age_s:
            return hit[1]
        schema: EngineSchema | None
        try:
            schema = await read_schema(python)
            self.failures.pop(python, None)
        except (runner.CommandFailed, ValueError) as err:
            why = getattr(err, "why", None) or str(err)
            log.warning("cannot read the vllm argument schema with %s: %s", python, why)
            self.failures[python] = why
            schema = None
        self._cache[python] = (time.monotonic(), schema)
        return schema

    async def problems(
        self,
        cfg: ModelEngineConfig | None,
        engine: EngineKind,
        settings: EngineConfig,
        weights: str,
    ) -> list[str]:
        """Why the engine's own options refuse ``cfg`` (asked once everything else is
        admitted: reading them imports the engine; none where they cannot be read, the types
        having been checked)."""
        if cfg is None:
            return []
        schema = await self.get(engine, settings)
        return [] if schema is None else engine_config_problems(cfg, engine, weights, schema)

    async def warm(self, config: XhpcConfig) -> None:
        """Read vLLM's schema ahead of use when the catalog gives a model an engine
        configuration (importing the engine takes seconds)."""
        if any(e.engine_config is not None for e in config.models.values()):
            await self.get(EngineKind.VLLM, config.engine(EngineKind.VLLM))
