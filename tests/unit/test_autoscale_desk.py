"""The broker's autoscaler (``xhpc.broker.desks.autoscale_desk``) on a broker with a recording
Slurm: the proxies' reports of in-flight requests scale a deployment up within its policy,
through `scale`'s admission; idle, it goes down to its minimum (0: asleep, still listed); a
call that finds no replica wakes it; a person's `xhpc scale` is refused; each change is one
log line with its inputs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.unit.test_broker_service import make
from xhpc.access import Caller
from xhpc.broker.desks import autoscale_desk
from xhpc.broker.service import BrokerService
from xhpc.errors import AdmissionError, ValidationError
from xhpc.models import (
    NodeInfo,
    ProxyLoad,
    ReplicaState,
    ScalingChange,
    ScalingPolicy,
    ServeRequest,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _load(service: BrokerService, **outstanding: int) -> None:
    """One proxy worker reports these requests in flight per replica."""
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=0, outstanding=outstanding))


async def test_demand_scales_up_within_the_policy_and_idle_sleeps_then_a_call_wakes(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    monkeypatch.setattr(autoscale_desk, "monotonic", clock)
    caplog.set_level(logging.INFO, logger=autoscale_desk.__name__)
    service, _ = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=0, max_replicas=3, target_in_flight=2, idle_s=60)
    dep = await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy))
    assert dep.scaling == policy and dep.wanted == 1
    (first,) = [r.replica_id for r in dep.replicas]
    # Its wake is in the table from the start: a call that finds no route it may use is held.
    assert "m" in service.proxies.routes().waking

    # 5 in flight at 2 per replica: 3 wanted (the policy's maximum), at once.
    _load(service, **{first: 5})
    await service.autoscaler.run()
    view = service.store.deployment_view("m")
    assert view.wanted == 3 and len([r for r in view.replicas if r.state.value != "STOPPED"]) == 3
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("autoscale")]
    assert "wanted=3 why=demand" in line and "load=5" in line and "max=3" in line

    # 50 in flight: never over the maximum.
    _load(service, **{first: 50})
    clock.now += 2
    await service.autoscaler.run()
    assert service.store.deployment_view("m").wanted == 3

    # A person's `xhpc scale` is refused: the broker sets the count.
    with pytest.raises(ValidationError, match="autoscaled"):
        await service.scale("m", 1, Caller(user="root", uid=0, admin=True))

    # No request for the idle window: down to the minimum, 0 (asleep), yet listed.
    _load(service)
    for _ in range(40):
        clock.now += 2
        await service.autoscaler.run()
    assert service.store.deployment_view("m").wanted == 0
    assert "m" in service.proxies.routes().models
    assert any("why=idle" in r.getMessage() for r in caplog.records)

    # A call that found no replica (a proxy counts it): woken, one replica.
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=0, unserved={"m": 1}))
    clock.now += 2
    await service.autoscaler.run()
    assert service.store.deployment_view("m").wanted == 1
    assert any("why=wake" in r.getMessage() for r in caplog.records)
    await service.autoscaler.close()


async def test_a_fixed_deployment_is_left_alone(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    dep = await service.serve(ServeRequest(model=str(model_dir), name="f", replicas=2))
    _load(service, **{r.replica_id: 40 for r in dep.replicas})
    await service.autoscaler.run()
    assert service.store.deployment_view("f").wanted == 2
    assert service.metrics.scaling.values == {}  # no decision made (xhpc.broker.metrics)
    assert service.autoscaler.scaled() == []
    assert service.proxies.routes().waking == {}  # its calls are never held
    await service.autoscaler.close()


def test_a_policy_outside_its_replicas_is_refused_at_the_door() -> None:
    with pytest.raises(ValueError, match="within the scaling policy"):
        ServeRequest(model="m", replicas=5, scaling=ScalingPolicy(min_replicas=1, max_replicas=3))
    with pytest.raises(ValueError, match="within the scaling policy"):
        ServeRequest(model="m", replicas=1, scaling=ScalingPolicy(min_replicas=2, max_replicas=3))


async def test_a_call_held_across_a_broker_restart_still_wakes_it(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """The gateways report the calls they hold as a level, not only as a counter: a broker
    that starts (no earlier count to compare with) still sees them."""
    service, _ = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=0, max_replicas=2)
    await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy))
    await service.scale("m", 0)  # asleep (the broker's own call)
    fresh = autoscale_desk.AutoscaleDesk(service, asyncio.Lock())  # a restarted broker's
    service.drains.heard(ProxyLoad(proxy_id="p", table_version=0, unserved={"m": 7}, held={"m": 1}))
    await fresh.run()
    assert service.store.deployment_view("m").wanted == 1
    await fresh.close()
    await service.autoscaler.close()


async def test_asleep_it_lives_on_and_stopped_it_ends(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    service, _ = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=0, max_replicas=2)
    for name in ("a", "b"):
        await service.serve(ServeRequest(model=str(model_dir), name=name, scaling=policy))
    await service.scale("a", 0)  # asleep by its policy (the broker's own call)
    for row in service.store.replicas(deployment="a", active_only=True):
        service.lifecycle.move(row, ReplicaState.STOPPED, "job CANCELLED")  # its jobs end
    assert service.store.live_deployment("a") is not None  # asleep: it lives on
    assert service.store.get_deployment("a").sleeping
    assert "a" in service.proxies.routes().models
    await service.stop("a")  # its owner stops it: it ends, asleep or not
    assert service.store.live_deployment("a") is None
    assert "a" not in service.proxies.routes().models
    await service.stop("b")  # awake: ends once its replicas have
    assert (
        service.store.live_deployment("b") is None or not service.store.get_deployment("b").sleeping
    )
    await service.autoscaler.close()


async def test_a_stopped_deployment_is_never_started_again_while_its_replicas_end(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path
) -> None:
    """Stopped while its replica drains (its job not ended yet): at zero and not asleep, a
    floor of 1 is no reason to start it again, neither at the autoscaler's next pass nor from
    one begun before the stop."""
    service, _ = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=1, max_replicas=2)
    await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy))
    (first,) = service.store.replicas(deployment="m", active_only=True)
    service.lifecycle.move(first, ReplicaState.READY, "engine answered")
    await service.stop("m")
    assert service.store.live_deployment("m") is not None  # its replica still drains
    _load(service, **{first.replica_id: 1})
    await service.autoscaler.run()
    active = service.store.replicas(deployment="m", active_only=True)
    assert [r.replica_id for r in active] == [first.replica_id]  # none started
    with pytest.raises(ValidationError, match="being stopped"):
        await service.scale("m", 1)  # a pass that read it before the stop
    await service.autoscaler.close()


async def test_a_refused_wake_is_told_to_the_gateways_and_asked_again_with_backoff(
    tmp_path: Path,
    idle_nodes: list[NodeInfo],
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(autoscale_desk, "monotonic", clock)
    service, _ = make(tmp_path, idle_nodes)
    policy = ScalingPolicy(min_replicas=0, max_replicas=2)
    await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy))
    await service.scale("m", 0)
    real_scale = service.scale
    asked: list[int] = []

    async def refusing(name: str, target: int, caller: Caller | None = None) -> object:
        asked.append(target)
        if len(asked) == 1:
            raise AdmissionError(["QOSMaxGRESPerUser: the account's GPUs are in use"])
        return await real_scale(name, target, caller)

    monkeypatch.setattr(service, "scale", refusing)
    held = ProxyLoad(proxy_id="p", table_version=0, held={"m": 1})
    service.drains.heard(held)
    await service.autoscaler.run()
    assert asked == [1] and service.store.get_deployment("m").wanted == 0
    waking = service.proxies.routes().waking["m"]
    assert waking.failed is not None and "QOSMaxGRESPerUser" in waking.failed
    clock.now += 0.5
    service.drains.heard(held)
    await service.autoscaler.run()
    assert asked == [1]  # not again at once
    clock.now += 1.0
    service.drains.heard(held)
    await service.autoscaler.run()
    assert asked == [1, 1] and service.store.get_deployment("m").wanted == 1
    assert service.proxies.routes().waking["m"].failed is None
    await service.autoscaler.close()


async def test_a_policy_changed_in_place_moves_the_count_into_its_bounds(
    tmp_path: Path, idle_nodes: list[NodeInfo], model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=autoscale_desk.__name__)
    service, _ = make(tmp_path, idle_nodes)
    owner = Caller(user="alice", uid=1001)
    policy = ScalingPolicy(min_replicas=0, max_replicas=3, target_in_flight=2, idle_s=60)
    await service.serve(ServeRequest(model=str(model_dir), name="m", scaling=policy, replicas=2))
    desk = service.autoscaler
    # Only the knobs given change; the count moves into the new bounds at once.
    view = await desk.change_policy("m", ScalingChange(max_replicas=1, idle_s=30), None)
    assert view.scaling == policy.model_copy(update={"max_replicas": 1, "idle_s": 30.0})
    assert view.wanted == 1
    assert service.store.deployment_view("m").scaling == view.scaling  # kept in the request
    assert any("policy min=0 max=1" in r.getMessage() for r in caplog.records)
    # Asleep, a minimum of 1 wakes it.
    await service.scale("m", 0)
    view = await desk.change_policy("m", ScalingChange(min_replicas=1), None)
    assert view.wanted == 1 and view.scaling is not None and view.scaling.min_replicas == 1
    # A fixed deployment needs --max to become autoscaled; then it is.
    await service.serve(ServeRequest(model=str(model_dir), name="f", replicas=1))
    with pytest.raises(ValidationError, match="not autoscaled"):
        await desk.change_policy("f", ScalingChange(min_replicas=0), None)
    view = await desk.change_policy("f", ScalingChange(min_replicas=0, max_replicas=2), None)
    assert view.scaling is not None and view.scaling.shown() == "auto 0..2" and view.wanted == 1
    # Bad bounds, nothing given, another member: refused, nothing changed.
    before = service.store.deployment_view("f")
    with pytest.raises(ValidationError, match="over max replicas"):
        await desk.change_policy("f", ScalingChange(min_replicas=3), None)
    with pytest.raises(ValidationError, match="no knob"):
        await desk.change_policy("f", ScalingChange(), None)
    with pytest.raises(PermissionError):
        await desk.change_policy("f", ScalingChange(max_replicas=5), owner)
    assert service.store.deployment_view("f") == before
    await desk.close()
