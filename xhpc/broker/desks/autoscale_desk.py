"""Deployments served with a scaling policy: sampled every reconcile pass, scaled by the policy
(xhpc.broker.plan.autoscale) through the same scaling as `xhpc scale`.

Each pass takes one :class:`Sample` per scaled deployment: the requests in flight to its
replicas and the requests that found none (asleep, or none READY), from the proxies' reports
(xhpc.broker.watch.drain), and the requests begun (the base's and its adapters'). The lead is
the deployment's slowest recent start (submission to READY), else ``[autoscale]
default_lead_s``. The cap is the policy's maximum, the site's ``[autoscale] max_replicas``, and
no more than now while a replica of it waits on its account's or QOS's limits (Slurm's pending
reason: more jobs would only queue behind it). A changed count is one log line with its inputs,
then `scale` (its admission and the site's job policy apply as for any caller).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from typing import TYPE_CHECKING

from pydantic import ValidationError as PydanticValidationError

from xhpc.access import Caller, check_owner
from xhpc.broker.admit.members import members
from xhpc.broker.plan.autoscale import Sample, decide
from xhpc.broker.plan.continuity import measured_start_s
from xhpc.broker.plan.desired import asleep, policy_of, stopping
from xhpc.broker.watch.engine_metrics import EngineScrapes
from xhpc.broker.watch.lifecycle import this_serving
from xhpc.changes import DeploymentChange
from xhpc.clock import monotonic
from xhpc.errors import ValidationError, XhpcError
from xhpc.models import (
    DeploymentView,
    ReplicaState,
    ScalingChange,
    ScalingPolicy,
    ServeRequest,
    Waking,
)
from xhpc.records import DeploymentRecord

if TYPE_CHECKING:
    from xhpc.broker.service import BrokerService

log = logging.getLogger(__name__)
S = ReplicaState
# Slurm's pending reasons that say a job waits on its account's or QOS's limits.
LIMITED = ("Assoc", "QOS")
KEPT_S = 600.0  # history kept beyond the longest window a policy looks at
RETRY_MAX_S = 60.0  # a refused scale is asked again after 1, 2, 4, ... s, up to this
STARTING = frozenset({S.CREATING, S.QUEUED, S.STARTING})
# A start on a busy cluster runs late: the estimate held callers get is the slowest recent start
# plus this share (measured: a wake 13 s long by its history took up to 15.6 s under load).
START_MARGIN = 1.25


class AutoscaleDesk:
    def __init__(self, service: BrokerService, lock: asyncio.Lock) -> None:
        self.svc = service
        self.lock = lock  # the broker's launch lock: a policy change reads, then writes
        self.history: dict[str, deque[Sample]] = {}
        self.last_change: dict[str, float] = {}
        self._unserved: dict[str, int] = {}  # the proxies' counter, at the last pass
        self.lead: dict[str, float] = {}  # each one's measured start (s), for the gateways
        self.refused: dict[str, str] = {}  # why its last scale was refused
        self._retry: dict[str, tuple[int, float]] = {}  # refusals in a row, next try at
        self.changes = 0  # counts changes of what ``waking`` gives (the routing table's)
        # Each READY vLLM engine's own metrics (a scaled deployment's every pass, the others
        # every 10 s): this desk's figures, and the broker's exposition (xhpc.broker.metrics).
        self.engines = EngineScrapes()

    async def close(self) -> None:
        await self.engines.close()

    def scaled(self) -> list[tuple[DeploymentRecord, ScalingPolicy]]:
        out = []
        for dep in self.svc.store.deployments():
            if dep.stopped_at is not None or dep.failed_reason is not None or stopping(dep):
                continue
            policy = policy_of(dep)
            if policy is not None:
                out.append((dep, policy))
        return out

    async def change_policy(
        self, name: str, change: ScalingChange, caller: Caller | None
    ) -> DeploymentView:
        """Change a deployment's scaling policy in place (`xhpc scale NAME --min --max ...`):
        the knobs given over its policy (a fixed deployment becomes autoscaled); its count
        moves into the new bounds at once, the rest is the policy's from the next pass."""
        async with self.lock:
            dep = self.svc.store.get_deployment(name)
            check_owner(caller, dep.owner, f"deployment {name!r}")
            if dep.stopped_at is not None or not dep.request:
                raise ValidationError(f"deployment {name!r} is not running")
            req = ServeRequest.model_validate_json(dep.request)
            try:
                policy = change.over(req.scaling)
            except PydanticValidationError as err:  # the first problem, in one line
                raise ValidationError(f"scaling policy: {err.errors()[0]['msg']}") from err
            except ValueError as err:
                raise ValidationError(f"scaling policy: {err}") from err
            replicas = min(max(req.replicas, max(1, policy.min_replicas)), policy.max_replicas)
            stored = req.model_copy(update={"scaling": policy, "replicas": replicas})
            ServeRequest.model_validate(stored.model_dump())  # the request's own checks
            self.svc.store.update_deployment(
                name, DeploymentChange(request=stored.model_dump_json())
            )
            log.info(
                "autoscale deployment=%s policy min=%d max=%d target=%g ttft_s=%s idle_s=%g "
                "down_window_s=%g (was %s)", name, policy.min_replicas, policy.max_replicas,
                policy.target, policy.ttft_s, policy.idle_s, policy.down_window_s,
                req.scaling.shown() if req.scaling else "fixed",
            )  # fmt: skip
            now = dep.wanted
            target = min(max(now, policy.min_replicas), policy.max_replicas)
            if asleep(dep) and policy.min_replicas > 0:
                target = policy.min_replicas
        if target != now:
            await self.svc.scale(name, target)
        return self.svc.store.deployment_view(name)

    def sample(self, dep: DeploymentRecord, now: float) -> Sample:
        drains = self.svc.drains
        active = self.svc.store.replicas(deployment=dep.name, active_only=True)
        in_flight = drains.in_flight()
        names = [dep.name, *(a.name for a in self.svc.adapter_desk.current() if a.base == dep.name)]
        begun = unserved = held = 0
        for name in names:
            b, u, h = drains.demand(name)
            begun, unserved, held = begun + b, unserved + u, held + h
        # Calls waiting for a replica: held by the gateways now (a level), and, while asleep,
        # those that found none since the last pass (refused at once: their callers would not
        # wait; counted only asleep, where a retried call cannot read as more load).
        before = self._unserved.get(dep.name)
        self._unserved[dep.name] = unserved
        if dep.wanted == 0 and before is not None:
            held += max(0, unserved - before)
        running, queued, kv_use, ttft = self.engines.of(r.replica_id for r in active)
        return Sample(
            at=now,
            running=round(running),
            waiting=round(queued),
            kv_use=None if kv_use is None else min(1.0, max(0.0, kv_use)),
            ttft_s=ttft,
            in_flight=sum(in_flight.get(r.replica_id, 0) for r in active),
            held=held,
            begun=begun + unserved,
        )

    async def run(self) -> None:
        """One pass: sample every scaled deployment, scale those whose count should change."""
        now = monotonic()
        cfg = self.svc.config.autoscale
        scaled = self.scaled()
        self.engines.kick(self.svc.store.replicas(active_only=True), {d.name for d, _ in scaled})
        for dep, policy in scaled:
            sample = self.sample(dep, now)
            hist = self.history.setdefault(dep.name, deque())
            hist.append(sample)
            keep = max(policy.idle_s, policy.down_window_s) + KEPT_S
            while hist and hist[0].at < now - keep:
                hist.popleft()
            views = self.svc.store.replicas(deployment=dep.name)
            serving = this_serving(dep, views)
            start = measured_start_s(members(serving, by_unit=dep.pd is not None))
            lead = start if start is not None else cfg.default_lead_s
            if self.lead.get(dep.name) != math.ceil(lead):  # whole seconds, not less
                self.lead[dep.name] = math.ceil(lead)
                self.changes += 1
            cap = policy.max_replicas
            if cfg.max_replicas is not None:
                cap = min(cap, cfg.max_replicas)
            if any(r.state is S.QUEUED and (r.reason or "").startswith(LIMITED) for r in serving):
                cap = min(cap, dep.wanted)
            verdict = decide(policy, list(hist), dep.wanted, lead_s=lead, now=now,
                             last_change_at=self.last_change.get(dep.name), cap=cap,
                             smooth_s=cfg.smooth_s, trend_min_s=cfg.trend_min_s)  # fmt: skip
            if verdict.wanted == dep.wanted:  # no change: not a decision (nor a metric's series)
                continue
            refusals, retry_at = self._retry.get(dep.name, (0, 0.0))
            if now < retry_at:
                continue  # refused lately: asked again after 1, 2, 4, ... 60 s
            self.svc.metrics.decided(dep.name, dep.wanted, verdict)
            self.last_change[dep.name] = now
            log.info(verdict.line(dep.name, dep.wanted))
            try:
                await self.svc.scale(dep.name, verdict.wanted)
            except XhpcError as err:
                log.warning("autoscale deployment=%s refused: %s", dep.name, err.one_line())
                self.refused[dep.name] = err.one_line()
                self.changes += 1
                self._retry[dep.name] = (refusals + 1, now + min(RETRY_MAX_S, 2.0**refusals))
            else:
                self._retry.pop(dep.name, None)
                if self.refused.pop(dep.name, None) is not None:
                    self.changes += 1
        gone = set(self.history) - {d.name for d, _ in self.scaled()}
        for name in gone:
            self.history.pop(name, None)
            self.last_change.pop(name, None)
            self._unserved.pop(name, None)
            self.lead.pop(name, None)
            self.refused.pop(name, None)
            self._retry.pop(name, None)

    def waking(self) -> dict[str, Waking]:
        """Each scaled deployment's wake, READY replicas or not (a gateway holds a call for it
        whenever none of its routes serves: asleep, starting, or its routes lost): when its
        newest start began (None: none is starting), how long its replicas take, and why it
        cannot be woken, if so."""
        out = {}
        for dep, _ in self.scaled():
            serving = this_serving(dep, self.svc.store.replicas(deployment=dep.name))
            starting = [r.created_at for r in serving if r.state in STARTING]
            failed = dep.failed_reason or self.refused.get(dep.name)
            newest = max(serving, key=lambda r: r.created_at, default=None)
            # Its wake failed (the keeper may try again: held calls are told now).
            if (
                failed is None
                and not starting
                and dep.wanted > 0
                and newest is not None
                and (newest.state is S.FAILED)
            ):
                failed = f"its replica {newest.replica_id} failed: {newest.reason}"
            # A promise the caller plans on: the slowest recent start, with its margin.
            lead = START_MARGIN * self.lead.get(dep.name, self.svc.config.autoscale.default_lead_s)
            notice = self.svc.config.broker.reconcile_interval_s
            out[dep.name] = Waking(
                since=max(starting, default=None), lead_s=lead, failed=failed, notice_s=notice
            )
        return out
