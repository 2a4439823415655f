"""The proxy's metrics, rendered as Prometheus text (exposition format 0.0.4) at ``/metrics``.

Written with ``xhpc.prometheus``'s primitives rather than ``prometheus_client`` (not a
dependency): the hot path does a dict lookup and an add per counter and a ``bisect`` per
histogram observation, with no locks (one event loop). Gauges (in flight, breaker state, ready
replicas) are read from the router when ``/metrics`` is scraped, so they cost the hot path
nothing.

Label values are bounded: a model label is a model in the routing table (``""`` otherwise, so
a client cannot grow the series by naming models), a replica label a replica id.

Several workers (`xhpc proxy --workers N`, decision 0010): a scrape reaches one worker, which
answers for the whole gateway. Each worker publishes a snapshot of its figures (``SharedMetrics``)
as a file in a private directory the supervisor made: at most every ``PUBLISH_INTERVAL_S``
(``publish_every``), at each scrape it answers, and at exit; never per request. A scrape sums
every snapshot there, the answering worker's own live figures, and ``retired.json``: the sums
of the workers that exited, which the supervisor folds in (``RetiredMetrics``), so a counter
never goes back when a worker dies or a reload replaces it. Per metric:

- counters and histograms: summed over every worker, live or gone;
- ``xhpc_proxy_in_flight``: summed over the live workers (requests in flight per replica);
- ``xhpc_proxy_breaker_state``: one series per live worker, labelled ``worker`` (its pid): each
  worker has its own breakers, and states do not add up;
- ``xhpc_proxy_breaker_ejections_total``: summed, for the replicas still in the routing table
  (a replica's series ends when it leaves, as with one process);
- ``xhpc_proxy_ready_replicas``: the answering worker's routing table (every worker polls the
  same broker; they differ for at most one refresh interval).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from fractions import Fraction
from pathlib import Path

from xhpc.prometheus import Counter, Histogram, Labels, gauge
from xhpc.proxy.process.metrics_files import (
    PUBLISH_INTERVAL_S,
    RETIRED_FILE,
    SNAPSHOT_SUFFIX,
    SNAPSHOT_VERSION,
    SharedMetrics,
    Snapshot,
    counter_entries,
    dumps,
    exact,
    is_count,
    labels_of,
    number_map,
    parse,
    read,
    replicas_of,
    write_private,
)
from xhpc.proxy.routes.breaker import STATE_VALUE, BreakerState
from xhpc.proxy.routes.routing import Router

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class ProxyMetrics:
    """Every series the proxy exports. Method calls are the hot path's only metric cost."""

    def __init__(self) -> None:
        self.requests = Counter(
            "xhpc_proxy_requests_total",
            "Requests answered, by model, last replica tried and HTTP status sent to the client.",
            ("model", "replica", "status"),
        )
        self.latency = Histogram(
            "xhpc_proxy_request_duration_seconds",
            "Time from the request's arrival to the end of its response (streams included).",
            ("model",),
            LATENCY_BUCKETS_S,
        )
        self.ttft = Histogram(
            "xhpc_proxy_ttft_seconds",
            "Time from a streamed request's arrival to its first event sent to the client.",
            ("model",),
            TTFT_BUCKETS_S,
        )
        self.tokens = Counter(
            "xhpc_proxy_tokens_total",
            "Tokens from the engines' usage reports: kind=prompt (in) or completion (out).",
            ("model", "kind"),
        )
        self.retries = Counter(
            "xhpc_proxy_retries_total",
            "Requests sent again to another replica before the client got a byte, by reason.",
            ("model", "reason"),
        )
        self.retries_denied = Counter(
            "xhpc_proxy_retries_denied_total",
            "Retries not made because the retry budget was spent.",
            ("model",),
        )
        self.stream_errors = Counter(
            "xhpc_proxy_stream_errors_total",
            "Streams that broke after the client got bytes (broken) or lacked [DONE] "
            "(unterminated); the proxy ended both well-formed.",
            ("model", "replica", "kind"),
        )
        # Prefill/decode models (xhpc.proxy.pd): each leg of the two-phase route.
        self.pd_legs = Counter(
            "xhpc_proxy_pd_legs_total",
            "Legs of prefill/decode requests sent, by role, instance and outcome (the engine's "
            "HTTP status, or why no answer came).",
            ("model", "role", "replica", "outcome"),
        )
        self.pd_prefill = Histogram(
            "xhpc_proxy_pd_prefill_seconds",
            "Time of a successful prefill leg, from sending it to its answer.",
            ("model",),
            LATENCY_BUCKETS_S,
        )
        self.pd_decode_ttft = Histogram(
            "xhpc_proxy_pd_decode_ttft_seconds",
            "Time from sending a streamed decode leg to its first event sent to the client.",
            ("model",),
            TTFT_BUCKETS_S,
        )
        self.pd_failures = Counter(
            "xhpc_proxy_pd_transfer_failures_total",
            "Failed legs: kind=prefill_failed (connect error, 5xx, timeout, unusable answer) or "
            "decode_failed (the same, or a stream that broke after its first event).",
            ("model", "kind"),
        )
        self.pd_handoffs = Counter(
            "xhpc_proxy_pd_handoffs_total",
            "Prefill answers handed to a decode leg, by whether they carried kv_transfer_params "
            "(NixlConnector's do; ExampleConnector's do not, and that is no failure).",
            ("model", "kv_params"),
        )
        # The router's breakers count ejections; this counter only holds the sums of snapshots
        # (several workers), and its name and help.
        self.ejections = Counter(
            "xhpc_proxy_breaker_ejections_total",
            "Times each replica's circuit breaker opened.",
            ("replica",),
        )
        self.shared: SharedMetrics | None = None  # set by ``share``: several workers

    def _counters(self) -> tuple[Counter, ...]:
        return (
            self.requests,
            self.tokens,
            self.retries,
            self.retries_denied,
            self.stream_errors,
            self.pd_legs,
            self.pd_failures,
            self.pd_handoffs,
        )

    def _histograms(self) -> tuple[Histogram, ...]:
        return (self.latency, self.ttft, self.pd_prefill, self.pd_decode_ttft)

    def _exposed(self) -> tuple[Counter | Histogram, ...]:
        """The counters and histograms in the order of the exposition."""
        return (
            self.requests,
            self.latency,
            self.ttft,
            self.tokens,
            self.retries,
            self.retries_denied,
            self.stream_errors,
            self.pd_legs,
            self.pd_prefill,
            self.pd_decode_ttft,
            self.pd_failures,
            self.pd_handoffs,
        )

    def request(self, model: str, replica: str, status: int, duration_s: float) -> None:
        self.requests.inc((model, replica, str(status)))
        self.latency.observe((model,), duration_s)

    def usage(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tokens.inc((model, "prompt"), prompt_tokens)
        self.tokens.inc((model, "completion"), completion_tokens)

    # --- several workers ---

    def share(self, directory: Path, name: str) -> None:
        """Answer scrapes for every worker publishing in ``directory``; publish this process's
        figures there as ``name`` (``publish``, ``publish_every``)."""
        self.shared = SharedMetrics(directory, name)

    def snapshot(self, router: Router) -> Snapshot:
        """This process's figures now, with the gauges read from ``router``."""
        counters = {c.name: [[list(k), v] for k, v in c.values.items()] for c in self._counters()}
        counters[self.ejections.name] = [[[rid], n] for rid, n in router.breakers.ejections.items()]
        histograms = {
            h.name: [[list(k), counts, total[0]] for k, (counts, total) in h.values.items()]
            for h in self._histograms()
        }
        return {
            "v": SNAPSHOT_VERSION,
            "pid": os.getpid() if self.shared is None else self.shared.pid,
            "counters": counters,
            "histograms": histograms,
            "in_flight": router.outstanding_all(),
            "breakers": {rid: STATE_VALUE[s] for rid, s in _breaker_states(router).items()},
        }

    def publish(self, router: Router) -> Snapshot:
        """Write this process's snapshot where the other workers read it (when it changed)."""
        snap = self.snapshot(router)
        if self.shared is not None:
            self.shared.publish(snap)
        return snap

    async def publish_every(self, router: Router, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        """``publish`` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.publish(router)
            except Exception:  # a bug here must not stop the worker's publications
                logger.exception("publishing this worker's metrics failed")

    # --- the exposition ---

    def render(self, router: Router) -> str:
        """The whole exposition, with gauges read from ``router`` now; with ``share``, the
        whole gateway's (the module docstring says how each metric is summed)."""
        if self.shared is None:
            lines = [line for series in self._exposed() for line in series.render()]
            states = _breaker_states(router).items()
            return self._finish(
                lines,
                router,
                router.outstanding_all(),
                [((rid,), STATE_VALUE[s]) for rid, s in states],
                ("replica",),
                self.ejections.render(_ejections(router)),
            )
        own = self.publish(router)  # first: a later scrape of another worker reads at least this
        peers, retired = self.shared.gather()
        live: list[tuple[str, Snapshot]] = [(self.shared.path.name, own), *peers]
        sums = Sums(self)
        for snap in (retired, *(snap for _, snap in live)):
            if snap is not None:
                sums.add(snap)
        keep = {r.replica_id for r in router.table.routes}
        in_flight: dict[str, int] = {}
        breakers: list[tuple[Labels, float]] = []
        for _, snap in live:
            keep.update(replicas_of(counter_entries(snap, self.ejections.name)))
            worker = str(snap.get("pid", ""))
            for rid, n in number_map(snap.get("in_flight")).items():
                in_flight[rid] = in_flight.get(rid, 0) + int(n)
            for rid, state in number_map(snap.get("breakers")).items():
                breakers.append(((rid, worker), state))
        ejections = {
            k: float(v) for k, v in sums.counters[self.ejections.name].items() if k[0] in keep
        }
        return self._finish(
            sums.render(),
            router,
            in_flight,
            breakers,
            ("replica", "worker"),
            self.ejections.render(ejections),
        )

    @staticmethod
    def _finish(
        lines: list[str],
        router: Router,
        in_flight: dict[str, int],
        breakers: Iterable[tuple[Labels, float]],
        breaker_labels: Sequence[str],
        ejections: list[str],
    ) -> str:
        """``lines`` (the counters and histograms) and the rest of the exposition."""
        live = [r.replica_id for r in router.table.routes]
        in_flight = {rid: 0 for rid in live} | in_flight
        lines += gauge(
            "xhpc_proxy_in_flight",
            "Requests in flight per replica.",
            ("replica",),
            (((rid,), n) for rid, n in in_flight.items()),
        )
        lines += gauge(
            "xhpc_proxy_breaker_state",
            "Circuit breaker per replica: 0 closed, 1 open (ejected), 2 half-open (probing).",
            breaker_labels,
            breakers,
        )
        lines += ejections
        ready: dict[str, int] = dict.fromkeys(router.table.models, 0)
        for route in router.table.routes:
            ready[route.model] = ready.get(route.model, 0) + 1
        lines += gauge(
            "xhpc_proxy_ready_replicas",
            "Replicas in the routing table per model.",
            ("model",),
            (((model,), n) for model, n in ready.items()),
        )
        return "\n".join(lines) + "\n"


class Sums:
    """Counters and histograms summed over snapshots, exactly (as fractions): a sum does not
    depend on the order its terms come in, so the gateway's totals never go back, not even by
    a rounding, whichever worker answers and whenever a worker's figures move into
    ``retired.json``. ``template`` gives the series (names, labels, buckets): what it does not
    know (another version's, after a reload) is left out."""

    def __init__(self, template: ProxyMetrics) -> None:
        self.template = template
        counters = (*template._counters(), template.ejections)
        self._counters = {c.name: c for c in counters}
        self._histograms = {h.name: h for h in template._histograms()}
        self.counters: dict[str, dict[Labels, Fraction]] = {c.name: {} for c in counters}
        self.histograms: dict[str, dict[Labels, tuple[list[int], Fraction]]] = {
            name: {} for name in self._histograms
        }

    def add(self, snap: Snapshot) -> None:
        counters = snap.get("counters")
        if isinstance(counters, dict):
            for name, counter in self._counters.items():
                self._add_counter(self.counters[name], counter, counters.get(name))
        histograms = snap.get("histograms")
        if isinstance(histograms, dict):
            for name, hist in self._histograms.items():
                self._add_histogram(self.histograms[name], hist, histograms.get(name))

    @staticmethod
    def _add_counter(into: dict[Labels, Fraction], counter: Counter, entries: object) -> None:
        if not isinstance(entries, list):
            return
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 2:
                continue
            labels = labels_of(entry[0], len(counter.labelnames))
            value = exact(entry[1])
            if labels is not None and value is not None:
                into[labels] = into.get(labels, Fraction(0)) + value

    @staticmethod
    def _add_histogram(
        into: dict[Labels, tuple[list[int], Fraction]], hist: Histogram, entries: object
    ) -> None:
        if not isinstance(entries, list):
            return
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 3:
                continue
            labels = labels_of(entry[0], len(hist.labelnames))
            counts, total = entry[1], exact(entry[2])
            if labels is None or total is None or not isinstance(counts, list):
                continue
            if len(counts) != len(hist.buckets) + 1 or not all(is_count(n) for n in counts):
                continue  # other buckets (other code, after a reload): left out
            old = into.get(labels)
            if old is None:
                into[labels] = (list(counts), total)
            else:
                into[labels] = (
                    [a + b for a, b in zip(old[0], counts, strict=True)],
                    old[1] + total,
                )

    def render(self) -> list[str]:
        """The exposition of the counters and histograms, in the template's order."""
        lines: list[str] = []
        for series in self.template._exposed():
            if isinstance(series, Counter):
                values = {k: float(v) for k, v in self.counters[series.name].items()}
                lines += series.render(values)
            else:
                hist = self.histograms[series.name]
                lines += series.render({k: (c, [float(t)]) for k, (c, t) in hist.items()})
        return lines

    def dump(self) -> Snapshot:
        """The sums as a snapshot (without gauges), each value exact: [numerator, denominator]."""

        def exact(value: Fraction) -> list[int]:
            return [value.numerator, value.denominator]

        return {
            "v": SNAPSHOT_VERSION,
            "counters": {
                name: [[list(k), exact(v)] for k, v in values.items()]
                for name, values in self.counters.items()
            },
            "histograms": {
                name: [[list(k), counts, exact(total)] for k, (counts, total) in values.items()]
                for name, values in self.histograms.items()
            },
        }


def _ejections(router: Router) -> dict[Labels, float]:
    return {(rid,): float(n) for rid, n in router.breakers.ejections.items()}


def _breaker_states(router: Router) -> dict[str, BreakerState]:
    """Every replica's breaker: those in the table (closed unless seen failing), and the others
    still held."""
    live = {r.replica_id: BreakerState.CLOSED for r in router.table.routes}
    return live | router.breakers.states()


class RetiredMetrics:
    """The supervisor's side (decision 0010): the sums of the workers that exited, in
    ``retired.json``, so that the gateway's counters never go back when one dies or a reload
    replaces it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.totals = Sums(ProxyMetrics())
        self.seq = 0

    def absorb(self, name: str) -> None:
        """Fold the last snapshot of the exited worker ``name`` into ``retired.json``, then
        remove its file. ``retired.json`` is replaced first and names ``name``, so that a
        scrape reading meanwhile skips the file (``SharedMetrics.gather``)."""
        path = self.directory / f"{name}{SNAPSHOT_SUFFIX}"
        snap = parse(read(path))
        if snap is not None:
            self.totals.add(snap)
            self.seq += 1
            doc = {**self.totals.dump(), "seq": self.seq, "absorbed": [name]}
            try:
                write_private(self.directory / RETIRED_FILE, dumps(doc))
            except OSError as err:
                logger.warning("cannot keep the metrics of proxy worker %s: %s", name, err)
                return  # its file stays, still summed as a worker's
        path.unlink(missing_ok=True)
        for stale in self.directory.glob(f".{path.name}.*"):  # a write cut by its death
            stale.unlink(missing_ok=True)
