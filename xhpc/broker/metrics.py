"""The broker's Prometheus exposition (``GET /v1/metrics``, decision 0036): its own metrics,
``xhpc_broker_*``, then every READY vLLM engine's series as its last scrape found them
(``xhpc.broker.watch.engine_metrics``), labelled with the deployment, replica, Slurm job and
node each runs on.

``BrokerMetrics`` is the one registry, owned by the service; the code paths that count call it
where they act, each with one line:

- the Slurm client's command chokepoint times every `sbatch` (``slurm_call``, wired by
  ``xhpc.broker.server``);
- ``Lifecycle`` observes a queue wait when a replica's job starts running (submission to
  STARTING), and counts a requeue when a running replica's job goes back to Slurm's queue;
- the keeper counts replacements and handovers (a successor submitted, or refused; a
  predecessor retired once its successor serves); the replanner counts the jobs it moves;
- the autoscaler counts each decision it makes, by direction and by the policy's reason.

Gauges are read when scraped: replicas per deployment and state (from the store), and each
engine's scrape age.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xhpc.broker.plan.autoscale import Verdict
from xhpc.clock import monotonic
from xhpc.prometheus import Counter, Histogram, Labels, gauge
from xhpc.states import ACTIVE

if TYPE_CHECKING:
    from xhpc.broker.service import BrokerService

QUEUE_WAIT_BUCKETS_S = (
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
    86400.0,
)  # fmt: skip
SBATCH_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SHOWN_STATES = tuple(sorted(s.value for s in ACTIVE))


def direction(current: int, wanted: int) -> str:
    """An autoscale verdict's direction: up, down, hold, wake (from 0) or sleep (to 0)."""
    if wanted == current:
        return "hold"
    if current == 0:
        return "wake"
    if wanted == 0:
        return "sleep"
    return "up" if wanted > current else "down"


class BrokerMetrics:
    """The broker's counters and histograms (its gauges are read at ``render``)."""

    def __init__(self) -> None:
        self.queue_waits = Histogram(
            "xhpc_broker_queue_wait_seconds",
            "Seconds from a replica's job submission to the job running, observed when it starts.",
            ("deployment",),
            QUEUE_WAIT_BUCKETS_S,
        )
        self.sbatch = Histogram(
            "xhpc_broker_sbatch_seconds",
            "Seconds each sbatch call took, by outcome (ok, failed).",
            ("outcome",),
            SBATCH_BUCKETS_S,
        )
        self.handovers = Counter(
            "xhpc_broker_handovers_total",
            "Walltime handovers: started (a successor submitted before its predecessor's job "
            "ends), refused (that submission failed), completed (the predecessor retired once "
            "its successor served).",
            ("deployment", "outcome"),
        )
        self.replacements = Counter(
            "xhpc_broker_replacements_total",
            "Replicas started again, by reason: replace (the keeper replaced an ended one), "
            "requeue (Slurm took its running job back to its queue), replan (its pending job "
            "moved to another node), lost (its lost job moved to another node).",
            ("deployment", "reason"),
        )
        self.scaling = Counter(
            "xhpc_broker_scaling_decisions_total",
            "Autoscaling changes of a replica count, by direction (up, down, wake, sleep) and the "
            "policy's reason.",
            ("deployment", "direction", "why"),
        )

    # --- the hooks ---

    def slurm_call(self, what: str, seconds: float, ok: bool) -> None:
        """One Slurm command ran (``xhpc.slurm.client.CliSlurmClient``'s chokepoint)."""
        if what == "sbatch":
            self.sbatch.observe(("ok" if ok else "failed",), seconds)

    def job_started(self, deployment: str, waited_s: float) -> None:
        self.queue_waits.observe((deployment,), max(0.0, waited_s))

    def handover(self, deployment: str, outcome: str) -> None:
        self.handovers.inc((deployment, outcome))

    def replaced(self, deployment: str, reason: str, count: int = 1) -> None:
        self.replacements.inc((deployment, reason), count)

    def decided(self, deployment: str, current: int, verdict: Verdict) -> None:
        self.scaling.inc((deployment, direction(current, verdict.wanted), verdict.why))

    # --- the exposition ---

    def render(self, svc: BrokerService) -> str:
        """The whole exposition now: these metrics, the gauges, the engines' series."""
        counts: dict[Labels, float] = {}
        for dep in svc.store.deployments():
            if dep.stopped_at is None:
                counts.update(((dep.name, state), 0) for state in SHOWN_STATES)
        for row in svc.store.replicas(active_only=True):
            key = (row.deployment, row.state.value)
            counts[key] = counts.get(key, 0) + 1
        now = monotonic()
        engines = svc.autoscaler.engines
        lines = gauge(
            "xhpc_broker_replicas",
            "Active replicas per deployment and state.",
            ("deployment", "state"),
            counts.items(),
        )
        for series in (
            self.queue_waits,
            self.sbatch,
            self.handovers,
            self.replacements,
            self.scaling,
        ):
            lines += series.render()
        lines += gauge(
            "xhpc_broker_engine_scrape_age_seconds",
            "Seconds since each READY vLLM engine's /metrics last answered the broker.",
            ("deployment", "replica"),
            ((tuple(v for _, v in where), age) for where, age in engines.ages(now)),
        )
        lines += engines.render(now)
        return "\n".join(lines) + "\n"
