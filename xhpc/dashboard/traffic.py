"""The proxy's traffic per model, from successive scrapes of its ``/metrics`` (pure).

``parse_metrics`` reads the few series `xhpc top` shows out of the Prometheus text the proxy
writes (xhpc/proxy/metrics.py): answers by model and status, the latency histogram by model,
and requests in flight by replica. ``TrafficWindow`` keeps the samples of the last
``window_s`` seconds and turns the oldest and the newest into rates: requests/s, 5xx
answers/s, and latency p50/p99 over that window (interpolated in the histogram's buckets, as
Prometheus' ``histogram_quantile`` does). A counter that went back (the whole proxy restarted)
counts from zero again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import Field

from xhpc.models import Frozen

REQUESTS = "xhpc_proxy_requests_total"
LATENCY_BUCKET = "xhpc_proxy_request_duration_seconds_bucket"
IN_FLIGHT = "xhpc_proxy_in_flight"
_WANTED = (REQUESTS, LATENCY_BUCKET, IN_FLIGHT)
MAX_LABEL_VALUE = 512  # longer label values are not the proxy's (its labels are names)


@dataclass(frozen=True)
class MetricsSample:
    """One scrape: counters by model, the latency buckets by model (``le`` -> cumulative
    count), in flight by replica; ``at_s``: when it was taken (monotonic seconds)."""

    at_s: float
    requests: Mapping[str, float] = field(default_factory=dict)
    errors: Mapping[str, float] = field(default_factory=dict)  # 5xx answers
    latency: Mapping[str, Mapping[float, float]] = field(default_factory=dict)
    in_flight: Mapping[str, float] = field(default_factory=dict)


class ModelTraffic(Frozen):
    """One model's traffic through the proxy; None: not known yet (one sample, no answer)."""

    model: str
    requests_total: int = Field(ge=0)
    requests_per_s: float | None = None
    errors_per_s: float | None = None  # answers with a 5xx status
    p50_s: float | None = None
    p99_s: float | None = None
    in_flight: int = 0
    window_s: float | None = None  # the span the rates are over


def _labels(text: str) -> dict[str, str] | None:
    """``a="x",b="y"`` (the inside of the braces) as a dict; None when it is not well formed."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            return None
        name = text[i:eq].strip()
        if not name.isidentifier():
            return None
        value: list[str] = []
        j = eq + 2
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(text[j + 1], text[j + 1]))
                j += 2
            else:
                value.append(text[j])
                j += 1
        if j >= n or len(value) > MAX_LABEL_VALUE:
            return None
        out[name] = "".join(value)
        i = j + 1
        if i < n and text[i] == ",":
            i += 1
    return out


def _series(line: str) -> tuple[str, dict[str, str], float] | None:
    """One sample line as (name, labels, value); None for what is not one of ours."""
    if not line.startswith(_WANTED):
        return None
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], _labels(line[brace + 1 : close]), line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    if name not in _WANTED or labels is None:
        return None
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return (name, labels, value) if math.isfinite(value) and value >= 0 else None


def _le(text: str) -> float | None:
    try:
        bound = float(text)
    except ValueError:
        return None
    return None if math.isnan(bound) else bound


def parse_metrics(text: str, at_s: float) -> MetricsSample:
    """The series `xhpc top` shows, out of the proxy's exposition; other lines are skipped."""
    requests: dict[str, float] = {}
    errors: dict[str, float] = {}
    latency: dict[str, dict[float, float]] = {}
    in_flight: dict[str, float] = {}
    for line in text.splitlines():
        parsed = _series(line)
        if parsed is None:
            continue
        name, labels, value = parsed
        model = labels.get("model", "")
        if name == REQUESTS and model:
            requests[model] = requests.get(model, 0.0) + value
            if labels.get("status", "").startswith("5"):
                errors[model] = errors.get(model, 0.0) + value
        elif name == LATENCY_BUCKET and model:
            bound = _le(labels.get("le", ""))
            if bound is not None:
                latency.setdefault(model, {})[bound] = value
        elif name == IN_FLIGHT and labels.get("replica"):
            in_flight[labels["replica"]] = value
    return MetricsSample(at_s, requests, errors, latency, in_flight)


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram given as cumulative counts by upper bound: linear
    inside its bucket (the first bucket starts at 0); the highest finite bound when it falls
    in the +Inf bucket; None with no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:  # then count > below: the bucket before held less than rank
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _delta(new: Mapping[float, float], old: Mapping[float, float]) -> dict[float, float]:
    if any(new.get(b, 0.0) < n for b, n in old.items()):
        return dict(new)  # a counter went back: the proxy restarted
    return {b: n - old.get(b, 0.0) for b, n in new.items()}


def _rate(new: float, old: float | None, span_s: float) -> float:
    gained = new if old is None or new < old else new - old
    return gained / span_s


class TrafficWindow:
    """The scrapes of the last ``window_s`` seconds: from the newest one at least that old
    (the rates span the whole window once it has passed), and at least the latest two."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.samples: deque[MetricsSample] = deque()

    def add(self, sample: MetricsSample) -> None:
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.at_s - self.samples[1].at_s >= self.window_s:
            self.samples.popleft()

    def traffic(self, model_of: Mapping[str, str]) -> tuple[ModelTraffic, ...]:
        """Per model, sorted by name; ``model_of``: each replica's model (its in-flight
        requests count for it; replicas it does not name are left out)."""
        if not self.samples:
            return ()
        new, old = self.samples[-1], self.samples[0]
        span = new.at_s - old.at_s if len(self.samples) > 1 else 0.0
        flying: dict[str, int] = {}
        for replica, n in new.in_flight.items():
            model = model_of.get(replica)
            if model is not None:
                flying[model] = flying.get(model, 0) + int(n)
        rows = []
        for model in sorted(set(new.requests) | set(flying)):
            total = new.requests.get(model, 0.0)
            row = ModelTraffic(
                model=model, requests_total=int(total), in_flight=flying.get(model, 0)
            )
            if span > 0:
                buckets = _delta(new.latency.get(model, {}), old.latency.get(model, {}))
                row = row.model_copy(
                    update={
                        "requests_per_s": _rate(total, old.requests.get(model), span),
                        "errors_per_s": _rate(
                            new.errors.get(model, 0.0), old.errors.get(model), span
                        ),
                        "p50_s": quantile(0.5, buckets),
                        "p99_s": quantile(0.99, buckets),
                        "window_s": span,
                    }
                )
            rows.append(row)
        return tuple(rows)
