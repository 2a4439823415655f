"""Unit tests for the circuit breakers, the retry budget and how the router uses them."""

from __future__ import annotations

import pytest

from xhpc.models import Route, RoutingTable
from xhpc.proxy.errors import NoReadyReplicaError
from xhpc.proxy.routes.breaker import Breakers, BreakerState, RetryBudget
from xhpc.proxy.routes.routing import Router
from xhpc.settings import ProxyConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def route(replica_id: str) -> Route:
    return Route(
        model="m", replica_id=replica_id, url=f"http://{replica_id}.invalid", served_model="m"
    )


def test_breaker_opens_after_k_consecutive_failures() -> None:
    b = Breakers(failures=3, cooldown_s=10)
    for _ in range(2):
        b.failure("a", 0.0)
    assert b.state("a") is BreakerState.CLOSED and b.available("a", 0.0)
    b.success("a")  # a success resets the count: failures must be consecutive
    for _ in range(2):
        b.failure("a", 0.0)
    assert b.state("a") is BreakerState.CLOSED
    b.failure("a", 1.0)
    assert b.state("a") is BreakerState.OPEN
    assert not b.available("a", 1.0)
    assert b.ejections == {"a": 1}


def test_breaker_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    b = Breakers(failures=1, cooldown_s=10)
    b.failure("a", 0.0)
    assert not b.available("a", 9.9)
    assert b.retry_after_s(["a"], 4.0) == pytest.approx(6.0)
    assert b.available("a", 10.0)
    b.picked("a", 10.0)
    assert b.state("a") is BreakerState.HALF_OPEN
    assert not b.available("a", 10.0)  # only one probe at a time
    b.success("a")
    assert b.state("a") is BreakerState.CLOSED and b.available("a", 10.0)
    assert b.states() == {}  # a healthy replica costs no entry


def test_breaker_failed_probe_reopens_for_another_cooldown() -> None:
    b = Breakers(failures=2, cooldown_s=10)
    b.failure("a", 0.0)
    b.failure("a", 0.0)
    b.picked("a", 10.0)
    b.failure("a", 10.0)  # a half-open breaker reopens on the first failure
    assert b.state("a") is BreakerState.OPEN
    assert not b.available("a", 19.0)
    assert b.available("a", 20.0)
    assert b.ejections == {"a": 2}


def test_breaker_probe_without_verdict_lets_the_next_request_probe() -> None:
    b = Breakers(failures=1, cooldown_s=10)
    b.failure("a", 0.0)
    b.picked("a", 10.0)
    b.neutral("a")  # the client left
    assert b.state("a") is BreakerState.OPEN
    assert b.available("a", 10.0)


def test_breaker_ignores_late_outcomes_while_open() -> None:
    b = Breakers(failures=1, cooldown_s=10)
    b.failure("a", 0.0)
    b.success("a")  # a request sent before the ejection
    b.failure("a", 5.0)
    assert b.state("a") is BreakerState.OPEN
    assert b.available("a", 10.0)  # the cool-down was not restarted


def test_breaker_forgets_replicas_that_left() -> None:
    b = Breakers(failures=1, cooldown_s=10)
    b.failure("a", 0.0)
    b.failure("b", 0.0)
    b.forget(["b"])
    assert b.states() == {"b": BreakerState.OPEN}
    assert b.ejections == {"b": 1}


def test_retry_budget_is_a_token_bucket() -> None:
    budget = RetryBudget(ratio=0.2, burst=2)
    assert budget.spend() and budget.spend()
    assert not budget.spend()
    for _ in range(4):
        budget.earn()
    assert not budget.spend()  # 0.8 of a retry
    budget.earn()
    assert budget.spend()
    for _ in range(100):
        budget.earn()
    assert budget.tokens == 2  # never more than the burst


def test_retry_budget_bounds_retries_to_a_ratio_of_requests() -> None:
    budget = RetryBudget(ratio=0.1, burst=5)
    retries = 0
    for _ in range(1000):  # every request fails and wants a retry
        budget.earn()
        retries += budget.spend()
    assert retries <= 5 + 0.1 * 1000
    assert retries >= 0.1 * 1000 - 1


# --- the router and its breakers ---


def make_router(clock: Clock, *ids: str, failures: int = 2, cooldown_s: float = 5.0) -> Router:
    config = ProxyConfig(breaker_failures=failures, breaker_cooldown_s=cooldown_s)
    routes = tuple(route(r) for r in ids)
    return Router(RoutingTable(version=1, models=("m",), routes=routes), config=config, clock=clock)


def test_router_skips_an_ejected_replica_and_probes_it_after_cooldown() -> None:
    clock = Clock()
    router = make_router(clock, "a", "b")
    a = route("a")
    router.failed(a)
    router.failed(a)
    assert router.breakers.state("a") is BreakerState.OPEN
    assert {router.pick("m").replica_id for _ in range(10)} == {"b"}
    clock.now += 5.0
    b = route("b")
    router.acquire(b)  # b busy: the probe goes to a
    assert router.pick("m").replica_id == "a"
    assert router.breakers.state("a") is BreakerState.HALF_OPEN
    assert {router.pick("m").replica_id for _ in range(5)} == {"b"}  # one probe only
    router.succeeded(a)
    assert router.breakers.state("a") is BreakerState.CLOSED
    assert router.pick("m").replica_id == "a"


def test_router_all_ejected_is_503_with_the_cooldown_left() -> None:
    clock = Clock()
    router = make_router(clock, "a", failures=1, cooldown_s=8.0)
    router.failed(route("a"))
    clock.now += 3.0
    with pytest.raises(NoReadyReplicaError) as info:
        router.pick("m")
    assert info.value.ejected
    assert info.value.retry_after_s == pytest.approx(5.0)


def test_router_exclude_leaves_no_candidate() -> None:
    router = make_router(Clock(), "a", "b")
    assert router.pick("m", exclude=["a"]).replica_id == "b"
    with pytest.raises(NoReadyReplicaError) as info:
        router.pick("m", exclude=["a", "b"])
    assert not info.value.ejected


def test_router_update_drops_breakers_of_removed_replicas() -> None:
    router = make_router(Clock(), "a", "b", failures=1)
    router.failed(route("a"))
    router.update(RoutingTable(version=2, models=("m",), routes=(route("b"),)))
    assert router.breakers.states() == {}
