"""Unit tests for the proxy's routing policy (pure logic, no I/O)."""

from __future__ import annotations

from collections import Counter

import pytest

from xhpc.errors import NotFoundError, XhpcError
from xhpc.models import Route, RoutingTable
from xhpc.proxy.routes.routing import NoReadyReplicaError, Router, UnknownModelError


def route(replica_id: str, model: str = "m") -> Route:
    return Route(
        model=model,
        replica_id=replica_id,
        url=f"http://{replica_id}.invalid:8000",
        served_model=f"/models/{model}",
    )


def table(*routes: Route, models: tuple[str, ...] | None = None, version: int = 1) -> RoutingTable:
    names = models if models is not None else tuple(sorted({r.model for r in routes}))
    return RoutingTable(version=version, models=names, routes=routes)


def test_unknown_model_is_a_not_found_error() -> None:
    router = Router(table(route("a"), models=("m", "other")))
    with pytest.raises(UnknownModelError) as info:
        router.pick("nope")
    assert isinstance(info.value, NotFoundError)
    assert info.value.code == "model_not_found"
    assert info.value.model == "nope"
    assert "m, other" in (info.value.hint or "")


def test_known_model_without_route_has_no_ready_replica() -> None:
    router = Router(table(route("a", "m"), models=("m", "cold")))
    with pytest.raises(NoReadyReplicaError) as info:
        router.pick("cold")
    assert isinstance(info.value, XhpcError)
    assert info.value.code == "no_ready_replica"


def test_empty_router_knows_no_model() -> None:
    with pytest.raises(UnknownModelError):
        Router().pick("m")


def test_picks_least_outstanding() -> None:
    a, b, c = route("a"), route("b"), route("c")
    router = Router(table(c, a, b))
    router.acquire(a)
    router.acquire(a)
    router.acquire(b)
    assert router.pick("m") == c
    router.acquire(c)
    router.acquire(c)
    assert router.pick("m") == b


def test_only_routes_of_the_requested_model() -> None:
    router = Router(table(route("a", "m"), route("b", "n")))
    assert {router.pick("m").replica_id for _ in range(5)} == {"a"}
    assert {router.pick("n").replica_id for _ in range(5)} == {"b"}


def test_ties_rotate_deterministically_in_replica_order() -> None:
    router = Router(table(route("b"), route("a"), route("c")))
    picks = [router.pick("m").replica_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_concurrent_leases_spread_evenly() -> None:
    router = Router(table(route("a"), route("b")))
    held: list[Route] = []
    for _ in range(8):
        chosen = router.pick("m")
        router.acquire(chosen)
        held.append(chosen)
    assert Counter(r.replica_id for r in held) == {"a": 4, "b": 4}
    assert router.outstanding("a") == 4
    for r in held:
        router.release(r)
    assert router.outstanding("a") == router.outstanding("b") == 0


def test_lease_counts_and_releases_on_exception() -> None:
    router = Router(table(route("a")))
    with router.lease("m") as chosen:
        assert chosen.replica_id == "a"
        assert router.outstanding("a") == 1
    assert router.outstanding("a") == 0
    with pytest.raises(RuntimeError), router.lease("m"):
        assert router.outstanding("a") == 1
        raise RuntimeError("engine exploded")
    assert router.outstanding("a") == 0


def test_lease_of_unknown_model_counts_nothing() -> None:
    router = Router(table(route("a")))
    with pytest.raises(UnknownModelError), router.lease("nope"):
        pass
    assert router.outstanding("a") == 0


def test_update_replaces_table_and_keeps_counters_of_remaining_replicas() -> None:
    a, b = route("a"), route("b")
    router = Router(table(a, b, version=1))
    router.acquire(a)
    router.acquire(b)
    new = table(a, route("c"), version=2)
    router.update(new)
    assert router.table is new
    assert router.outstanding("a") == 1
    # c is idle, a is busy: c wins; b is gone from the table and is never picked
    assert router.pick("m").replica_id == "c"
    assert {router.pick("m").replica_id for _ in range(4)} == {"c"}


def test_release_after_replica_removed_never_goes_negative() -> None:
    a = route("a")
    router = Router(table(a))
    router.acquire(a)
    router.update(table(route("b")))
    assert router.outstanding("a") == 1  # still in flight, still counted
    router.release(a)
    assert router.outstanding("a") == 0
    router.release(a)  # a stray release is harmless
    assert router.outstanding("a") == 0
    router.update(table(a, route("b")))
    assert router.outstanding("a") == 0


def test_in_flight_count_survives_remove_and_readd() -> None:
    a, b = route("a"), route("b")
    router = Router(table(a, b))
    router.acquire(a)
    router.update(table(b))
    router.update(table(a, b))
    assert router.outstanding("a") == 1
    assert router.pick("m") == b
