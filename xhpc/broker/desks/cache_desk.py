"""The weights cache: the ledger's reads, what agents report they staged, and removals.

The shared model store's copies are the site catalog's models whose weights are under
``models_dir``: each is digested once (in a thread; the digest is kept) the first time the
ledger is read after it appears, and again only when its path changes. Node-local copies are
recorded as jobs' agents report them (``xhpc.agent.staging``). A node-local copy is removed where
it is, by a short Slurm job on its node (``xhpc/templates/cache.sbatch.j2`` running
``xhpc.agent.staging evict``), which takes the copy's lock, so a replica staging it at that
moment either finishes first or stages it again after. The ledger forgets the copy when that
job is submitted; a copy the job could not remove is found again at the next staging.
Copies pulled into the shared store (``xhpc cache pull``) are recorded by ``pull_desk``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path

from xhpc.broker.desks.pull_desk import PullDesk, submit_cache_job
from xhpc.catalog import resolve_model
from xhpc.errors import NotFoundError, XhpcError
from xhpc.render import CacheSbatchParams
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store import Store
from xhpc.store.cache import CacheLedger
from xhpc.weights import (
    CacheCopy,
    CacheOutcome,
    CachePrune,
    CacheRemove,
    StagedCopy,
    WeightsError,
    prune_plan,
    refuse_in_use,
    tree_digest,
)

log = logging.getLogger(__name__)
CACHE_PREFIX = "xhpc-cache:"  # the --comment of the cache's jobs (not a replica's tag)


class CacheDesk:
    def __init__(
        self, config: XhpcConfig, store: Store, slurm: SlurmClient, broker_id: str, python: str
    ) -> None:
        self.config = config
        self.store = store
        self.slurm = slurm
        self.ledger = CacheLedger(store)
        self.broker_id = broker_id
        self.agent_python = python
        self._digesting = asyncio.Lock()
        # `xhpc cache pull`: copies into the shared store, recorded here when their job reports.
        self.pulls = PullDesk(config, slurm, self.ledger, broker_id, python)

    @property
    def jobs_dir(self) -> Path:
        return self.config.resolved_state_dir / "cache"

    def _alive(self) -> set[str]:
        return {r.replica_id for r in self.store.replicas(active_only=True)}

    # -- reads ----------------------------------------------------------------------------------
    async def copies(self) -> list[CacheCopy]:
        await self.refresh_shared()
        return self.ledger.copies(self._alive())

    def holders(self, model: str) -> frozenset[str]:
        """The nodes that hold a node-local copy of ``model``."""
        return frozenset(c.node for c in self.ledger.copies(model=model) if c.node is not None)

    async def refresh_shared(self) -> None:
        """Record each site catalog model under ``models_dir`` not yet in the ledger (or moved)."""
        models_dir = self.config.models_dir
        if models_dir is None:
            return
        async with self._digesting:
            for name in sorted(self.config.models):
                path = self._shared_path(name)
                if path is None or not path.is_dir():
                    continue
                known = self.ledger.shared(name)
                if known is not None and known.path == str(path):
                    continue
                try:
                    digest, size = await asyncio.to_thread(tree_digest, path)
                except WeightsError as err:
                    log.warning("weights of %s not in the cache ledger: %s", name, err.message)
                    continue
                self.ledger.record(name, None, str(path), size, digest)

    # -- reports from agents --------------------------------------------------------------------
    def staged(self, replica_id: str, node: str, copy: StagedCopy) -> None:
        """A replica's agent staged (or reused) a node-local copy: record it and its use. A
        fresh copy of a catalog model's shared copy that the ledger does not know yet brings
        the shared copy's digest (the agent computed it from the bytes it read): the next
        replicas' agents check their node's copy against it."""
        self.ledger.record(
            copy.model, node, copy.path, copy.size_bytes, copy.digest, user=replica_id
        )
        shared = self.ledger.shared(copy.model)
        if shared is None and not copy.reused and copy.source is not None:
            path = self._shared_path(copy.model)
            if path is not None and str(path) == copy.source:
                self.ledger.record(
                    copy.model, None, copy.source, copy.size_bytes, copy.digest, user=replica_id
                )
        elif shared is not None:  # the shared copy was read (or stands behind the local one)
            self.ledger.record(
                copy.model, None, shared.path, shared.size_bytes, shared.digest, user=replica_id
            )

    def _shared_path(self, model: str) -> Path | None:
        """Where the site catalog puts ``model``'s weights in the shared store (None: not a
        catalog model under ``models_dir``), as :meth:`refresh_shared` digests them."""
        entry = self.config.models.get(model)
        models_dir = self.config.models_dir
        if entry is None or models_dir is None:
            return None
        return entry.weights_path(models_dir)

    # -- removals -------------------------------------------------------------------------------
    async def remove(self, req: CacheRemove) -> CacheOutcome:
        copies = [c for c in self.ledger.copies(self._alive(), model=req.model) if c.node]
        if req.node is not None:
            copies = [c for c in copies if c.node == req.node]
        if not copies:
            where = f" on {req.node}" if req.node else ""
            raise NotFoundError(
                f"no node-local copy of {req.model!r}{where} in the cache ledger",
                hint="xhpc cache ls shows the copies; the shared store is never removed by xhpc",
            )
        refuse_in_use(copies)
        if not req.dry_run:
            await self._evict(copies)
        return CacheOutcome(removed=tuple(copies), dry_run=req.dry_run)

    async def prune(self, req: CachePrune) -> CacheOutcome:
        copies = self.ledger.copies(self._alive(), node=req.node)
        removed, kept = prune_plan(copies, req.budget_bytes, req.node)
        if removed and not req.dry_run:
            await self._evict(removed)
        return CacheOutcome(removed=tuple(removed), kept=tuple(kept), dry_run=req.dry_run)

    async def _evict(self, copies: Sequence[CacheCopy]) -> None:
        """One short job per node removes that node's copies; the ledger forgets them."""
        local_dir = self.config.cache.local_dir
        if local_dir is None:
            raise XhpcError(
                "node-local copies are removed under [cache] local_dir, which is not set",
                hint="set [cache] local_dir in the site config to the nodes' cache directory",
            )
        by_node: dict[str, list[CacheCopy]] = {}
        for c in copies:
            if c.node is not None:
                by_node.setdefault(c.node, []).append(c)
        self.jobs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for node, here in sorted(by_node.items()):
            job_key = f"evict-{node}-{secrets.token_hex(3)}"
            params = CacheSbatchParams(
                job_name=f"xhpc-cache-{job_key}",
                comment=f"{CACHE_PREFIX}{self.broker_id}:{job_key}",
                action="evict",
                args=(str(local_dir), *sorted(c.model for c in here)),
                partition=self.config.slurm.partition,
                account=self.config.slurm.account,
                time="00:10:00",
                nodelist=node,
                output=str(self.jobs_dir / f"{job_key}-%j.out"),
                agent_python=self.agent_python,
            )
            job_id = await submit_cache_job(self.slurm, self.jobs_dir / f"{job_key}.sbatch", params)
            log.info("cache: job %s removes %s on %s", job_id, [c.model for c in here], node)
            for c in here:
                self.ledger.forget(c.model, c.node)

    def model_path(self, model: str) -> Path:
        """The shared store's path of a catalog model (for pulls and staging)."""
        return resolve_model(model, self.config).path
