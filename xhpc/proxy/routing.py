"""Routing policy for the proxy: least outstanding requests among a model's READY replicas.

Pure logic, no I/O. The proxy's hot path reads only this in-memory state; the routing table
itself is refreshed in the background (see ``xhpc.proxy.source``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from xhpc.errors import NotFoundError, XhpcError
from xhpc.models import Route, RoutingTable


class UnknownModelError(NotFoundError):
    """The requested model is not served by this deployment at all (HTTP 404)."""

    code = "model_not_found"

    def __init__(self, model: str, known: tuple[str, ...]) -> None:
        self.model = model
        self.known = known
        hint = f"served models: {', '.join(known)}" if known else "no models are deployed"
        super().__init__(f"model {model!r} does not exist", hint=hint)


class NoReadyReplicaError(XhpcError):
    """The model is deployed but no replica of it is READY right now (HTTP 503)."""

    code = "no_ready_replica"

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(
            f"model {model!r} has no ready replica",
            hint="replicas may still be starting; retry later or check `xhpc ps`",
        )


class Router:
    """Holds the current routing table and the outstanding-request count of every replica.

    ``pick`` chooses, among the routes of a model, one with the fewest outstanding requests;
    ties go round-robin over the tied routes in ``replica_id`` order, so the choice is
    deterministic for a given sequence of calls. ``lease`` picks and counts the request until
    the ``with`` block exits, whether it exits normally or by an exception.
    """

    def __init__(self, table: RoutingTable | None = None) -> None:
        self._table = RoutingTable()
        self._by_model: dict[str, tuple[Route, ...]] = {}
        self._outstanding: dict[str, int] = {}
        self._turn: dict[str, int] = {}
        self._live: frozenset[str] = frozenset()
        self.update(table or RoutingTable())

    @property
    def table(self) -> RoutingTable:
        return self._table

    def update(self, table: RoutingTable) -> None:
        """Replace the table in one step; counters survive for replicas that remain."""
        by_model: dict[str, list[Route]] = {}
        for route in table.routes:
            by_model.setdefault(route.model, []).append(route)
        live = frozenset(r.replica_id for r in table.routes)
        self._outstanding = {rid: n for rid, n in self._outstanding.items() if rid in live or n > 0}
        self._live = live
        self._by_model = {
            model: tuple(sorted(routes, key=lambda r: r.replica_id))
            for model, routes in by_model.items()
        }
        self._turn = {m: t for m, t in self._turn.items() if m in self._by_model}
        self._table = table

    def outstanding(self, replica_id: str) -> int:
        return self._outstanding.get(replica_id, 0)

    def outstanding_all(self) -> dict[str, int]:
        """In-flight requests per replica, including replicas that left the table."""
        return {rid: n for rid, n in self._outstanding.items() if n > 0}

    def pick(self, model: str) -> Route:
        """The route to use for ``model`` now; does not count the request (see ``lease``)."""
        routes = self._by_model.get(model, ())
        if not routes:
            if model in self._table.models:
                raise NoReadyReplicaError(model)
            raise UnknownModelError(model, self._table.models)
        least = min(self.outstanding(r.replica_id) for r in routes)
        tied = [r for r in routes if self.outstanding(r.replica_id) == least]
        turn = self._turn.get(model, 0)
        self._turn[model] = turn + 1
        return tied[turn % len(tied)]

    def acquire(self, route: Route) -> None:
        self._outstanding[route.replica_id] = self.outstanding(route.replica_id) + 1

    def release(self, route: Route) -> None:
        left = self.outstanding(route.replica_id) - 1
        if left > 0:
            self._outstanding[route.replica_id] = left
        elif route.replica_id in self._live:
            self._outstanding[route.replica_id] = 0
        else:
            self._outstanding.pop(route.replica_id, None)

    @contextmanager
    def lease(self, model: str) -> Iterator[Route]:
        """Pick a route for ``model`` and count it as outstanding for the ``with`` block."""
        route = self.pick(model)
        self.acquire(route)
        try:
            yield route
        finally:
            self.release(route)
