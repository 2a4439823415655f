"""The proxy's metrics, rendered as Prometheus text (exposition format 0.0.4) at ``/metrics``.

Written here rather than with ``prometheus_client`` (not a dependency): the hot path does a dict
lookup and an add per counter and a ``bisect`` per histogram observation, with no locks (one
event loop). Gauges (in flight, breaker state, ready replicas) are read from the router when
``/metrics`` is scraped, so they cost the hot path nothing.

Label values are bounded: a model label is a model in the routing table (``""`` otherwise, so
a client cannot grow the series by naming models), a replica label a replica id.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from xhpc.proxy.breaker import STATE_VALUE, BreakerState
from xhpc.proxy.routing import Router

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def _header(name: str, help_: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]


class Counter:
    __slots__ = ("help", "labelnames", "name", "values")

    def __init__(self, name: str, help_: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.help = help_
        self.labelnames = tuple(labelnames)
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def render(self) -> list[str]:
        lines = _header(self.name, self.help, "counter")
        for labels, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.labelnames, labels)} {_num(value)}")
        return lines


class Histogram:
    __slots__ = ("buckets", "help", "labelnames", "name", "values")

    def __init__(
        self, name: str, help_: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.help = help_
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(buckets)
        self.values: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        entry = self.values.get(labels)
        if entry is None:
            entry = self.values[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value

    def render(self) -> list[str]:
        lines = _header(self.name, self.help, "histogram")
        for labels, (counts, total) in sorted(self.values.items()):
            running = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                le = _labels(self.labelnames, labels, f'le="{_num(bound)}"')
                lines.append(f"{self.name}_bucket{le} {running}")
            shown = _labels(self.labelnames, labels)
            lines.append(f"{self.name}_sum{shown} {_num(total[0])}")
            lines.append(f"{self.name}_count{shown} {running}")
        return lines


def _gauge(name: str, help_: str, labelname: str, values: Iterable[tuple[str, float]]) -> list[str]:
    lines = _header(name, help_, "gauge")
    for label, value in sorted(values):
        lines.append(f'{name}{{{labelname}="{_escape(label)}"}} {_num(value)}')
    return lines


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

    def request(self, model: str, replica: str, status: int, duration_s: float) -> None:
        self.requests.inc((model, replica, str(status)))
        self.latency.observe((model,), duration_s)

    def usage(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tokens.inc((model, "prompt"), prompt_tokens)
        self.tokens.inc((model, "completion"), completion_tokens)

    def render(self, router: Router) -> str:
        """The whole exposition, with gauges read from ``router`` now."""
        lines: list[str] = []
        for series in (self.requests, self.latency, self.ttft, self.tokens):
            lines += series.render()
        for counter in (self.retries, self.retries_denied, self.stream_errors):
            lines += counter.render()
        for series in (
            self.pd_legs,
            self.pd_prefill,
            self.pd_decode_ttft,
            self.pd_failures,
            self.pd_handoffs,
        ):
            lines += series.render()
        live = [r.replica_id for r in router.table.routes]
        in_flight = {rid: 0 for rid in live} | router.outstanding_all()
        lines += _gauge(
            "xhpc_proxy_in_flight",
            "Requests in flight per replica.",
            "replica",
            in_flight.items(),
        )
        states = {rid: BreakerState.CLOSED for rid in live} | router.breakers.states()
        lines += _gauge(
            "xhpc_proxy_breaker_state",
            "Circuit breaker per replica: 0 closed, 1 open (ejected), 2 half-open (probing).",
            "replica",
            ((rid, STATE_VALUE[s]) for rid, s in states.items()),
        )
        lines += _header(
            "xhpc_proxy_breaker_ejections_total",
            "Times each replica's circuit breaker opened.",
            "counter",
        )
        for rid, n in sorted(router.breakers.ejections.items()):
            lines.append(f'xhpc_proxy_breaker_ejections_total{{replica="{_escape(rid)}"}} {n}')
        ready: dict[str, int] = dict.fromkeys(router.table.models, 0)
        for route in router.table.routes:
            ready[route.model] = ready.get(route.model, 0) + 1
        lines += _gauge(
            "xhpc_proxy_ready_replicas",
            "Replicas in the routing table per model.",
            "model",
            ready.items(),
        )
        return "\n".join(lines) + "\n"
