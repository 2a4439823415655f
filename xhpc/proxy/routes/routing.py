"""The router: the in-memory routing table, in-flight counts, policies and circuit breakers.

Pure logic, no I/O. The proxy's hot path reads only this state; the routing table itself is
refreshed in the background (see ``xhpc.proxy.source``). Which replica takes a request is the
model's policy's choice (``xhpc.proxy.routes.policies``) among the replicas its breaker lets
through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager

from xhpc.models import PdRole, Route, RoutingTable
from xhpc.proxy.errors import NoReadyReplicaError, UnknownModelError
from xhpc.proxy.routes.breaker import Breakers
from xhpc.proxy.routes.policies import Policy, RequestInfo, make_policy
from xhpc.settings import ProxyConfig

__all__ = ["NoReadyReplicaError", "Router", "UnknownModelError"]

Clock = Callable[[], float]


class Router:
    """Holds the current routing table and the outstanding-request count of every replica.

    ``pick`` asks the model's policy (``proxy.model_routing``, else ``proxy.routing``; least
    outstanding by default) to choose among the model's replicas that are neither ejected by
    their breaker nor in ``exclude``. ``acquire``/``release`` count a request in flight;
    ``lease`` picks and counts it until the ``with`` block exits, normally or by an exception.
    ``succeeded``/``failed``/``abandoned`` feed the replica's breaker.

    A model whose routes carry a ``role`` is a prefill/decode model (``is_pd``): ``pick`` with
    ``role`` chooses among that role's instances only, with the role's own policy
    (``proxy.pd_prefill_routing``/``pd_decode_routing``); see ``xhpc.proxy.pd``.
    """

    def __init__(
        self,
        table: RoutingTable | None = None,
        *,
        config: ProxyConfig | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config or ProxyConfig()
        self.clock = clock
        self.breakers = Breakers(self.config.breaker_failures, self.config.breaker_cooldown_s)
        self._table = RoutingTable()
        self._by_model: dict[str, tuple[Route, ...]] = {}
        self._known: frozenset[str] = frozenset()
        # Per model since this worker started: requests sent to a replica, and requests for a
        # listed model that had none (asleep, or not READY yet): the broker's demand signals.
        self._begun: dict[str, int] = {}
        self._unserved: dict[str, int] = {}
        self.held: dict[str, int] = {}  # calls held for a replica now (xhpc.proxy.routes.holding)
        self._outstanding: dict[str, int] = {}
        self._policies: dict[str, Policy] = {}
        self._by_role: dict[tuple[str, PdRole], tuple[Route, ...]] = {}
        self._pd: frozenset[str] = frozenset()
        self._role_policies: dict[tuple[str, PdRole], Policy] = {}
        self._live: frozenset[str] = frozenset()
        self._by_replica: dict[str, Route] = {}
        self._plain_info: dict[str, RequestInfo] = {}  # RequestInfo(model), made once
        self._unreachable: set[str] = set()  # connect failures, told to the broker at sync
        self._changed = asyncio.Event()  # set (and replaced) at each update
        self.update(table or RoutingTable())

    @property
    def table(self) -> RoutingTable:
        return self._table

    def route(self, replica_id: str) -> Route | None:
        """The replica's route in the table, if it has one."""
        return self._by_replica.get(replica_id)

    def routes(self, model: str) -> tuple[Route, ...]:
        """The model's routes in the table (every role's)."""
        return self._by_model.get(model, ())

    def knows(self, model: str) -> bool:
        return model in self._known

    def excluded(self, tried: Mapping[str, str]) -> list[str]:
        """Of the replicas a call tried (replica id -> the url it tried), those whose route is
        still that one: a replica re-planned as a new job (a new url) may be tried again."""
        return [
            rid
            for rid, url in tried.items()
            if (route := self._by_replica.get(rid)) is None or route.url == url
        ]

    def usable(self, model: str, exclude: Collection[str] = ()) -> bool:
        """Whether ``pick`` would find a route for ``model`` outside ``exclude`` now (one
        whose breaker lets a request through)."""
        now = self.clock()
        return any(
            r.replica_id not in exclude and self.breakers.available(r.replica_id, now)
            for r in self._by_model.get(model, ())
        )

    def update(self, table: RoutingTable) -> None:
        """Replace the table in one step; counters survive for replicas that remain."""
        by_model: dict[str, list[Route]] = {}
        for route in table.routes:
            by_model.setdefault(route.model, []).append(route)
        self._by_replica = {r.replica_id: r for r in table.routes}
        live = frozenset(self._by_replica)
        self._outstanding = {rid: n for rid, n in self._outstanding.items() if rid in live or n > 0}
        self._live = live
        self._by_model = {
            model: tuple(sorted(routes, key=lambda r: r.replica_id))
            for model, routes in by_model.items()
        }
        self._known = frozenset(table.models) | frozenset(self._by_model)
        self._policies = {m: p for m, p in self._policies.items() if m in self._known}
        by_role: dict[tuple[str, PdRole], list[Route]] = {}
        for model, routes in self._by_model.items():
            for route in routes:
                if route.role is not None:
                    by_role.setdefault((model, route.role), []).append(route)
        self._by_role = {key: tuple(routes) for key, routes in by_role.items()}
        self._pd = frozenset(model for model, _ in self._by_role)
        self._role_policies = {k: p for k, p in self._role_policies.items() if k[0] in self._pd}
        self.breakers.forget(live)
        self._plain_info = {}
        self._table = table
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> bool:
        """Wait until the table is updated (True) or ``timeout_s`` passes (False)."""
        event = self._changed
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def is_pd(self, model: str) -> bool:
        """Whether the model is served prefill/decode disaggregated (its routes have roles)."""
        return model in self._pd

    def policy(self, model: str, role: PdRole | None = None) -> Policy:
        """The model's (or its role's) policy object, made on first use; it keeps its own turn
        counters."""
        if role is not None:
            key = (model, role)
            found = self._role_policies.get(key)
            if found is None:
                c = self.config
                name = c.pd_prefill_routing if role is PdRole.PREFILL else c.pd_decode_routing
                found = make_policy(name, load_factor=c.affinity_load_factor)
                self._role_policies[key] = found
            return found
        policy = self._policies.get(model)
        if policy is None:
            name = self.config.model_routing.get(model, self.config.routing)
            policy = make_policy(name, load_factor=self.config.affinity_load_factor)
            self._policies[model] = policy
        return policy

    def outstanding(self, replica_id: str) -> int:
        return self._outstanding.get(replica_id, 0)

    def outstanding_all(self) -> dict[str, int]:
        """In-flight requests per replica, including replicas that left the table."""
        return {rid: n for rid, n in self._outstanding.items() if n > 0}

    def pick(
        self,
        model: str,
        info: RequestInfo | None = None,
        *,
        exclude: Collection[str] = (),
        role: PdRole | None = None,
    ) -> Route:
        """The route to use for ``model`` (only its ``role`` instances, if given) now; does
        not count the request (see ``lease``).

        Raises UnknownModelError for a model not in the table, NoReadyReplicaError when it has
        no replica, or none outside ``exclude`` whose breaker lets a request through.
        """
        if role is None:
            routes = self._by_model.get(model, ())
        else:
            routes = self._by_role.get((model, role), ())
        if not routes:
            if model in self._known:
                self.unserved(model)
                raise NoReadyReplicaError(model, role=role)
            raise UnknownModelError(model, self._table.models)
        candidates = routes
        breakers = self.breakers
        tripped = breakers.any_tripped
        now = self.clock() if tripped else 0.0
        if exclude or tripped:
            candidates = tuple(
                r
                for r in routes
                if r.replica_id not in exclude and breakers.available(r.replica_id, now)
            )
            if not candidates:
                allowed = [r.replica_id for r in routes if r.replica_id not in exclude]
                wait = breakers.retry_after_s(allowed, now)
                raise NoReadyReplicaError(
                    model, ejected=bool(allowed), retry_after_s=wait, role=role
                )
        if info is None:
            info = self._plain_info.get(model)
            if info is None:
                info = self._plain_info[model] = RequestInfo(model)
        route = self.policy(model, role).pick(info, candidates, self)
        if tripped:
            breakers.picked(route.replica_id, now)
        return route

    def acquire(self, route: Route) -> None:
        self._outstanding[route.replica_id] = self.outstanding(route.replica_id) + 1
        self._begun[route.model] = self._begun.get(route.model, 0) + 1

    def unserved(self, model: str) -> None:
        """A call for ``model`` found no replica (it was refused, or is held for one)."""
        self._unserved[model] = self._unserved.get(model, 0) + 1

    def demand(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Per model, for the broker's autoscaling: requests sent and requests that found no
        replica since this worker started (counters), and calls held for a replica now."""
        return dict(self._begun), dict(self._unserved), {m: n for m, n in self.held.items() if n}

    def release(self, route: Route) -> None:
        left = self.outstanding(route.replica_id) - 1
        if left > 0:
            self._outstanding[route.replica_id] = left
        elif route.replica_id in self._live:
            self._outstanding[route.replica_id] = 0
        else:
            self._outstanding.pop(route.replica_id, None)

    def succeeded(self, route: Route) -> None:
        self.breakers.success(route.replica_id)

    def failed(self, route: Route) -> None:
        self.breakers.failure(route.replica_id, self.clock())

    def abandoned(self, route: Route) -> None:
        self.breakers.neutral(route.replica_id)

    def unreachable(self, route: Route) -> None:
        """A connect to the replica failed (refused, timed out): a fault of its own, and news
        for the broker, which takes it out of every proxy's table until its agent answers."""
        self.breakers.failure(route.replica_id, self.clock())
        self._unreachable.add(route.replica_id)

    def unreachable_again(self, replica_id: str) -> None:
        self._unreachable.add(replica_id)

    def take_unreachable(self) -> tuple[str, ...]:
        """The replicas found unreachable since the last call (for the next sync)."""
        found, self._unreachable = tuple(sorted(self._unreachable)), set()
        return found

    @contextmanager
    def lease(self, model: str, info: RequestInfo | None = None) -> Iterator[Route]:
        """Pick a route for ``model`` and count it as outstanding for the ``with`` block."""
        route = self.pick(model, info)
        self.acquire(route)
        try:
            yield route
        finally:
            self.release(route)
