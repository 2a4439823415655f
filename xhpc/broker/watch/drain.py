"""Knowing when a draining replica has no traffic left: the proxies' reports of their load.

Each proxy, when it fetches routes, reports the version of the table it holds and its in-flight
requests per replica. A replica is drained when every proxy heard from recently holds a table
without it and has no request in flight to it (or when no proxy is heard from at all).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from xhpc.clock import monotonic
from xhpc.models import ProxyLoad, RoutingTable

SERVED_TABLES_KEPT = 64


@dataclass(frozen=True)
class _Heard:
    load: ProxyLoad
    at: float


class DrainBook:
    def __init__(self, proxy_silence_s: float = 10.0) -> None:
        self.proxy_silence_s = proxy_silence_s
        self._served: OrderedDict[int, frozenset[str]] = OrderedDict()
        self._proxies: dict[str, _Heard] = {}

    def served(self, table: RoutingTable) -> None:
        """Remember which replicas a table version routes to."""
        self._served[table.version] = frozenset(r.replica_id for r in table.routes)
        self._served.move_to_end(table.version)
        while len(self._served) > SERVED_TABLES_KEPT:
            self._served.popitem(last=False)

    def heard(self, load: ProxyLoad) -> None:
        self._proxies[load.proxy_id] = _Heard(load, monotonic())

    def _recent(self) -> list[ProxyLoad]:
        now = monotonic()
        return [h.load for h in self._proxies.values() if now - h.at <= self.proxy_silence_s]

    def outstanding(self, replica_id: str) -> int:
        """In-flight requests to ``replica_id`` over the proxies heard from recently."""
        return sum(p.outstanding.get(replica_id, 0) for p in self._recent())

    def in_flight(self) -> dict[str, int]:
        """In-flight requests per replica over the proxies heard from recently."""
        totals: dict[str, int] = {}
        for load in self._recent():
            for replica_id, n in load.outstanding.items():
                totals[replica_id] = totals.get(replica_id, 0) + n
        return totals

    def demand(self, model: str) -> tuple[int, int, int]:
        """For ``model``: requests sent and requests that found no replica, summed over every
        proxy worker heard from (counters: a restarted broker or worker starts them again),
        and the calls held for a replica by the workers heard from recently."""
        heard = [h.load for h in self._proxies.values()]
        return (
            sum(p.begun.get(model, 0) for p in heard),
            sum(p.unserved.get(model, 0) for p in heard),
            sum(p.held.get(model, 0) for p in self._recent()),
        )

    def proxies_heard(self) -> int:
        """How many proxies (workers) synced within ``proxy_silence_s``."""
        return len(self._recent())

    def routed(self, replica_ids: Iterable[str]) -> bool:
        """Whether every proxy heard from recently holds a table that routes all of these
        replicas (True when no proxy is heard from: nothing to wait for)."""
        wanted = frozenset(replica_ids)
        for load in self._recent():
            routes = self._served.get(load.table_version)
            if routes is None or not wanted <= routes:
                return False
        return True

    def drained(self, replica_id: str) -> bool:
        for load in self._recent():
            routes = self._served.get(load.table_version)
            if routes is None or replica_id in routes:
                return False  # this proxy may still send it new requests
            if load.outstanding.get(replica_id, 0) > 0:
                return False
        return True
