"""What the broker gives the proxies: the routing table and the key grants, and when each
proxy last fetched the grants (so that a new key is usable once `xhpc keys create` returns)."""

from __future__ import annotations

import asyncio
import hashlib

from xhpc.access import Grants, ModelAccess
from xhpc.broker.desks.adapter_desk import AdapterDesk
from xhpc.broker.desks.autoscale_desk import AutoscaleDesk
from xhpc.broker.desks.unit_desk import UnitDesk
from xhpc.broker.plan.desired import asleep
from xhpc.broker.watch.drain import DrainBook
from xhpc.clock import monotonic
from xhpc.models import ReplicaState, Route, RoutingTable
from xhpc.store import Store
from xhpc.store.keys import Keys

S = ReplicaState
ROUTE_WATCH_S = 0.02  # how often a held sync looks for a write to the store
PROXY_SILENCE_S = 10.0  # a proxy not heard from for this long is not waited for
KEY_PROPAGATION_S = 5.0  # a new key waits this long at most for the proxies to fetch it
MAX_PROXIES_REMEMBERED = 1024


class ProxyDesk:
    def __init__(
        self,
        store: Store,
        unit_desk: UnitDesk,
        drains: DrainBook,
        keys: Keys,
        adapters: AdapterDesk | None = None,
        autoscaler: AutoscaleDesk | None = None,
    ) -> None:
        self.store = store
        self.epoch = 0  # the lease token this broker leads with (the server sets it)
        self.adapters = adapters
        self.autoscaler = autoscaler
        self.unit_desk = unit_desk
        self.drains = drains
        self.keys = keys
        self.grant_syncs: dict[str, float] = {}  # proxy id -> when it last fetched the grants
        self._table: tuple[tuple[int, int, int], RoutingTable] | None = None  # (_changes(), table)

    def routes(self) -> RoutingTable:
        """The routing table: made again only after a write that may change it
        (``Store.writes``), however many proxies wait for it."""
        changes = self._changes()
        if self._table is not None and self._table[0] == changes:
            return self._table[1]
        table = self._routes()
        self._table = (changes, table)
        return table

    def _changes(self) -> tuple[int, int, int]:
        """What the table depends on: the store's writes, where adapters are loaded, and what
        the autoscaler says of deployments it wakes."""
        return (
            self.store.writes,
            self.adapters.changes if self.adapters is not None else 0,
            self.autoscaler.changes if self.autoscaler is not None else 0,
        )

    def _routes(self) -> RoutingTable:
        rows = self.store.replicas(active_only=True)
        # A deployment exists until its owner stops it: with no READY replica (between a
        # failure and its replacement, a requeue) the proxy answers 503 + Retry-After, not 404.
        live = {
            d.name
            for d in self.store.deployments()
            if d.stopped_at is None and (d.wanted > 0 or asleep(d))  # asleep: woken by a call
        }
        models = sorted(live | {r.deployment for r in rows if r.state is not S.DRAINING})
        ready_units = self.unit_desk.ready_units()
        routes = tuple(
            Route(
                model=r.deployment,
                replica_id=r.replica_id,
                url=f"http://{r.host}:{r.port}",
                served_model=r.served_model or r.deployment,
                secret=r.engine_secret,
                role=r.role,
                unit=r.unit,
                max_model_len=r.max_model_len,
                agent_port=r.agent_port,
                engine=r.engine,
            )
            for r in rows
            if r.state is S.READY
            and r.host
            and r.port
            # A PD instance takes traffic only once its whole unit is READY.
            and (r.unit is None or r.unit in ready_units)
        )
        parents: dict[str, str] = {}
        if self.adapters is not None:  # an adapter is a model of its own while its base lives
            parents = {a.name: a.base for a in self.adapters.current()}
            models = sorted({*models, *parents})
            routes = (*routes, *self.adapters.routes(routes))
        waking = {}
        if self.autoscaler is not None:
            waking = self.autoscaler.waking()
        table = RoutingTable(
            models=tuple(models), routes=routes, parents=parents, waking=waking, epoch=self.epoch
        )
        # A content digest: equal tables have equal versions, across broker restarts too.
        digest = hashlib.sha256(table.model_dump_json().encode()).hexdigest()
        table = table.model_copy(update={"version": int(digest[:8], 16)})
        self.drains.served(table)
        return table

    async def routes_after(self, version: int, wait_s: float) -> RoutingTable:
        """The table once it differs from ``version``, or after ``wait_s`` as it is then.

        It is recomputed only after a write to the store, the only way it can change; so a
        READY replica reaches a waiting proxy within ``ROUTE_WATCH_S`` of its commit."""
        deadline = monotonic() + wait_s
        seen = self._changes()
        table = self.routes()
        while table.version == version and monotonic() < deadline:
            await asyncio.sleep(min(ROUTE_WATCH_S, max(0.0, deadline - monotonic())))
            if self._changes() != seen:
                seen = self._changes()
                table = self.routes()
        return table

    def access(self) -> tuple[ModelAccess, ...]:
        """Each live deployment's owner and account: who may use it."""
        live = [d for d in self.store.deployments() if d.stopped_at is None]
        own = [ModelAccess(model=d.name, owner=d.owner, account=d.account) for d in live]
        if self.adapters is not None:  # an adapter is keyed as a model: its owner's, its
            # base's account's (its owner is the base's, or an admin who added it)
            accounts = {d.name: d.account for d in live}
            own += [
                ModelAccess(model=a.name, owner=a.owner, account=accounts.get(a.base))
                for a in self.adapters.current()
            ]
        return tuple(own)

    def grants(self) -> Grants:
        """The live keys and each served model's owner and account, for the proxies."""
        return Grants(keys=tuple(self.keys.grants()), access=self.access())

    def grants_for(self, proxy_id: str) -> Grants:
        """The grants, for a proxy that fetches them now (its sync is remembered)."""
        self.grant_syncs[proxy_id] = monotonic()
        if len(self.grant_syncs) > MAX_PROXIES_REMEMBERED:
            oldest = min(self.grant_syncs, key=self.grant_syncs.__getitem__)
            del self.grant_syncs[oldest]
        return self.grants()

    async def grants_reach_proxies(self, since: float) -> None:
        """Wait (``KEY_PROPAGATION_S`` at most) until every proxy heard from lately fetched the
        grants after ``since``: a key is usable the moment `xhpc keys create` returns."""
        recent = [p for p, at in self.grant_syncs.items() if since - at <= PROXY_SILENCE_S]
        deadline = since + KEY_PROPAGATION_S
        while monotonic() < deadline and any(self.grant_syncs[p] < since for p in recent):
            await asyncio.sleep(0.05)
