"""LoRA adapters on deployments: added and removed by their owners, loaded on every READY
replica of their base while it runs (vLLM's runtime adapter API), routed by name only where
loaded.

The desk keeps which adapters each READY replica holds (in memory: after a broker restart an
engine that has one already answers that it is loaded, which counts as loaded). A replica's
adapters are loaded when its agent registers, before it is READY (``registering``): a new
replica, a successor, a replacement or a woken one takes its adapters' traffic the moment it
takes its base's, so a handover leaves no gap. ``sync``, after every reconcile pass, loads what
a READY replica still lacks (an adapter added since, a load that failed), unloads what was
removed, and forgets replicas that are no longer READY. ``routes`` gives the routing table each
adapter's routes: its base's replicas that hold it, under its own name. Each load is recorded
in the weights ledger (model ``adapter:NAME``, the shared copy, used by that replica).
"""

from __future__ import annotations

import asyncio
import getpass
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from time import monotonic

import aiohttp

from xhpc.access import Caller, check_owner
from xhpc.adapters import CONFIG_FILE, WEIGHTS_FILE, adapter_problems
from xhpc.broker.plan.desired import stored_request
from xhpc.broker.watch.engine_calls import EngineCalls
from xhpc.clock import utcnow
from xhpc.errors import AdmissionError, NotFoundError, ValidationError
from xhpc.models import EngineKind, ReplicaState, Route, check_name
from xhpc.records import AdapterRecord, AdapterView, ReplicaRecord
from xhpc.store import Store
from xhpc.store.adapters import Adapters
from xhpc.store.cache import CacheLedger
from xhpc.weights import WeightsError, tree_digest

log = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
CALL_TIMEOUT_S = 10.0  # one load or unload (an engine that hangs holds up only its replica)
RETRY_MAX_S = 60.0  # a load that failed is tried again after 1, 2, 4, ... s, up to this
_ALREADY = "already been loaded"
REGISTER_LOAD_S = 10.0  # at most this long loading adapters before a replica is READY


def ledger_model(name: str) -> str:
    """An adapter's name in the weights ledger (apart from the catalog's models)."""
    return f"adapter:{name}"


class AdapterDesk:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.adapters = Adapters(store)
        self.ledger = CacheLedger(store)
        self.loaded: dict[str, set[str]] = {}  # READY replica id -> adapter names it holds
        self.load_s: dict[tuple[str, str], float] = {}  # (replica, adapter) -> s after READY
        self.changes = 0  # counts changes of ``loaded``: the routing table depends on it
        self._calls = EngineCalls(CALL_TIMEOUT_S)
        self._lock = asyncio.Lock()  # one load or unload pass at a time
        self._failed: dict[tuple[str, str], tuple[int, float]] = {}  # -> (failures, retry at)

    async def close(self) -> None:
        await self._calls.close()

    async def _call(self, row: ReplicaRecord, path: str, body: dict[str, str]) -> str | None:
        """POST ``body`` to the replica's engine; None on success, else why not."""
        headers = {"Authorization": f"Bearer {row.engine_secret}"} if row.engine_secret else {}
        url = f"http://{row.host}:{row.port}{path}"
        try:
            async with self._calls.session().post(url, json=body, headers=headers) as resp:
                if resp.status == 200:
                    return None
                text = (await resp.text())[:300]
                return None if _ALREADY in text else f"HTTP {resp.status}: {text}"
        except (aiohttp.ClientError, TimeoutError) as err:
            return type(err).__name__

    async def _load(self, row: ReplicaRecord, adapter: AdapterRecord) -> bool:
        """Load ``adapter`` on the replica's engine; True when it holds it now."""
        why = await self._call(
            row, LOAD_PATH, {"lora_name": adapter.name, "lora_path": adapter.path}
        )
        key = (row.replica_id, adapter.name)
        if why is not None:
            n = self._failed.get(key, (0, 0.0))[0] + 1
            self._failed[key] = (n, monotonic() + min(RETRY_MAX_S, 2.0 ** (n - 1)))
            log.warning(
                "adapter %s not loaded on %s (%d): %s", adapter.name, row.replica_id, n, why
            )
            return False
        self._failed.pop(key, None)
        self.loaded.setdefault(row.replica_id, set()).add(adapter.name)
        after = (utcnow() - row.ready_at).total_seconds() if row.ready_at else 0.0
        self.load_s[(row.replica_id, adapter.name)] = round(max(0.0, after), 3)
        self.changes += 1
        self.ledger.record(
            ledger_model(adapter.name), None, adapter.path, adapter.size_bytes, adapter.digest,
            user=row.replica_id,
        )  # fmt: skip
        log.info("adapter %s loaded on %s", adapter.name, row.replica_id)
        return True

    @asynccontextmanager
    async def registering(self, row: ReplicaRecord, host: str, port: int) -> AsyncIterator[None]:
        """A replica's agent registers its engine at ``host:port``: its deployment's adapters are
        loaded there first (``REGISTER_LOAD_S`` at most; what fails, ``sync`` loads later), and
        no sync runs until the registration is through (it would forget a replica not READY)."""
        async with self._lock:
            at = row.model_copy(update={"host": host, "port": port, "ready_at": None})
            try:
                async with asyncio.timeout(REGISTER_LOAD_S):
                    for adapter in self.current():
                        if adapter.base != row.deployment:
                            continue
                        await self._load(at, adapter)
            except TimeoutError:
                log.warning(
                    "adapters of %s: loading took over %ss", row.replica_id, REGISTER_LOAD_S
                )
            yield

    async def sync(self, rows: Iterable[ReplicaRecord]) -> None:
        """Each READY replica holds exactly the adapters of its deployment."""
        async with self._lock:
            await self._sync(rows)

    def kick(self, rows: Iterable[ReplicaRecord]) -> None:
        """``sync`` in the background (the reconcile pass never waits on an engine); skipped
        while the last one runs (the next pass kicks again)."""
        rows = list(rows)
        self._calls.start(lambda: self.sync(rows))

    def current(self) -> list[AdapterRecord]:
        """The adapters whose base is the serving they were added to, still live."""
        live = {d.name: d.created_at for d in self.store.deployments() if d.stopped_at is None}
        return [a for a in self.adapters.all() if live.get(a.base) == a.base_created_at]

    def _forget_stale(self) -> None:
        """An adapter goes with its base: once that serving ended (a deployment served again
        under its name later is another one, perhaps another user's)."""
        keep = {a.name for a in self.current()}
        for adapter in self.adapters.all():
            if adapter.name not in keep:
                self.adapters.remove(adapter.name)
                self.ledger.forget(ledger_model(adapter.name), None)
                log.info("adapter %s removed: its base %s ended", adapter.name, adapter.base)

    async def _sync(self, rows: Iterable[ReplicaRecord]) -> None:
        self._forget_stale()
        ready = {r.replica_id: r for r in rows if r.state is ReplicaState.READY and r.host}
        for gone in set(self.loaded) - set(ready):
            del self.loaded[gone]
            self.changes += 1
        self.load_s = {k: v for k, v in self.load_s.items() if k[0] in ready}
        wanted: dict[str, list[AdapterRecord]] = {}
        for adapter in self.current():
            wanted.setdefault(adapter.base, []).append(adapter)
        # Each replica's calls in turn, the replicas at once: one that hangs holds up only its own.
        await asyncio.gather(
            *(self._sync_one(r, wanted.get(r.deployment, [])) for r in ready.values())
        )
        self._failed = {k: v for k, v in self._failed.items() if k[0] in ready}

    async def _sync_one(self, row: ReplicaRecord, mine: list[AdapterRecord]) -> None:
        rid = row.replica_id
        held = self.loaded.setdefault(rid, set())
        for adapter in mine:
            retry_at = self._failed.get((rid, adapter.name), (0, 0.0))[1]
            if adapter.name not in held and monotonic() >= retry_at:
                await self._load(row, adapter)
        for name in sorted(held - {a.name for a in mine}):  # removed since it was loaded
            why = await self._call(row, UNLOAD_PATH, {"lora_name": name})
            held.discard(name)
            self.load_s.pop((rid, name), None)
            self.changes += 1
            if why is not None:
                log.warning("adapter %s not unloaded from %s: %s", name, rid, why)

    def routes(self, base_routes: Sequence[Route]) -> list[Route]:
        """Each adapter's routes: its base's routes on replicas that hold it, by its name."""
        out = []
        by_base: dict[str, list[Route]] = {}
        for route in base_routes:
            by_base.setdefault(route.model, []).append(route)
        for adapter in self.current():
            for route in by_base.get(adapter.base, ()):
                if adapter.name in self.loaded.get(route.replica_id, ()):
                    update = {"model": adapter.name, "served_model": adapter.name}
                    out.append(route.model_copy(update=update))
        return out

    def views(self) -> list[AdapterView]:
        """Every adapter, with the READY replicas that hold it now."""
        return [
            AdapterView(
                **a.model_dump(),
                loaded_on=tuple(sorted(r for r, held in self.loaded.items() if a.name in held)),
                load_s={r: s for (r, n), s in self.load_s.items() if n == a.name},
            )
            for a in self.adapters.all()
        ]

    def add(self, name: str, base: str, path: str, caller: Caller | None) -> AdapterRecord:
        """Admit and record adapter ``name`` on deployment ``base`` (the caller's): every
        reason it cannot be served at once (AdmissionError), nothing recorded then."""
        _name(name, "adapter name")
        dep = self.store.live_deployment(_name(base, "deployment name"))
        if dep is None:
            raise NotFoundError(f"no running deployment named {base!r}", hint="`xhpc ps`")
        check_owner(caller, dep.owner, f"deployment {base!r}")
        problems = []
        if self.store.live_deployment(name) is not None:
            problems.append(f"a deployment is named {name!r}: an adapter is called by its name")
        req = stored_request(dep, 1)
        lora = req.engine_config.lora if req.engine_config is not None else None
        if dep.engine is not EngineKind.VLLM or lora is None:
            problems.append(
                f"deployment {base!r} has no room for adapters: serve it with vLLM and "
                '`--engine-config \'{"lora": {"max_lora_rank": 16}}\'` (or its catalog entry\'s)'
            )
        where = Path(path)
        if not where.is_absolute():
            problems.append(f"adapter path {path!r} must be absolute")
        else:
            problems += adapter_problems(where, lora.max_lora_rank if lora else 512)
            problems += _not_theirs(where, caller)
        if problems:
            raise AdmissionError(problems)
        try:
            digest, size = tree_digest(where)
        except WeightsError as err:
            raise AdmissionError([err.message]) from None
        record = AdapterRecord(
            name=name,
            base=base,
            path=str(where),
            owner=caller.user if caller is not None else getpass.getuser(),
            digest=digest,
            size_bytes=size,
            created_at=utcnow(),
            base_created_at=dep.created_at,
        )
        self.adapters.add(record)
        return record

    def remove(self, name: str, caller: Caller | None = None) -> AdapterRecord:
        """Forget the adapter (its routes go at once; engines unload it at the next sync)."""
        _name(name, "adapter name")
        try:
            adapter = self.adapters.get(name)
        except NotFoundError:
            raise NotFoundError(f"no adapter {name!r}", hint="`xhpc adapters list`") from None
        check_owner(caller, adapter.owner, f"adapter {name!r}")
        gone = self.adapters.remove(name)
        self.ledger.forget(ledger_model(name), None)
        return gone


def _name(value: str, what: str) -> str:
    """A name as the control API's callers give it: a bad one is a 400, never a 500."""
    try:
        return check_name(value, what)
    except ValueError as err:
        raise ValidationError(str(err)) from None


def _not_theirs(where: Path, caller: Caller | None) -> list[str]:
    """An engine reads the adapter with its job's permissions: the caller's own files only (an
    admin's or the broker's own call: any)."""
    if caller is None or caller.admin:
        return []
    return [
        f"{f} is not yours (uid {f.lstat().st_uid}, you are {caller.uid})"
        for f in (where, where / CONFIG_FILE, where / WEIGHTS_FILE)
        if f.lstat().st_uid != caller.uid
    ]
