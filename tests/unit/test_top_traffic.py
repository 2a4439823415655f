"""`xhpc top`'s traffic: the proxy's /metrics read (xhpc.dashboard.traffic) and turned into
rates between scrapes. tests/data/top/metrics-{1,2}.txt are two expositions of the proxy's own
``ProxyMetrics`` 10 s apart (``python -m tests.unit.test_top_traffic`` writes them again)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xhpc.dashboard.traffic import (
    MetricsSample,
    TrafficWindow,
    parse_metrics,
    quantile,
)
from xhpc.models import Route, RoutingTable
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.routes.routing import Router

TOP = Path(__file__).resolve().parent.parent / "data" / "top"
MODELS = {"tiny-llama-0": "tiny-llama", "tiny-llama-1": "tiny-llama", "qwen-0": "qwen"}


def _proxy(requests: list[tuple[str, str, int, float]], flying: int) -> str:
    """The exposition of a real ProxyMetrics after ``requests`` (model, replica, status, s)
    with ``flying`` requests in flight to tiny-llama-0."""
    routes = tuple(
        Route(model=m, replica_id=r, url="http://10.0.0.1:9000", served_model=m)
        for r, m in MODELS.items()
    )
    router = Router(RoutingTable(version=1, models=("qwen", "tiny-llama"), routes=routes))
    metrics = ProxyMetrics()
    for model, replica, status, seconds in requests:
        metrics.request(model, replica, status, seconds)
    metrics.request("", "", 404, 0.001)  # a model not in the table: no model of ours
    for _ in range(flying):
        router.acquire(routes[0])
    return metrics.render(router)


FIRST = [("tiny-llama", "tiny-llama-0", 200, 0.08)] * 30 + [("qwen", "qwen-0", 200, 1.5)] * 4
# 10 s later: 20 more to tiny-llama (2 of them 502s, slow), 0 more to qwen
SECOND = (
    FIRST
    + [("tiny-llama", "tiny-llama-1", 200, 0.2)] * 18
    + [("tiny-llama", "tiny-llama-1", 502, 3.0)] * 2
)


def _samples() -> tuple[MetricsSample, MetricsSample]:
    one = parse_metrics((TOP / "metrics-1.txt").read_text(), at_s=100.0)
    two = parse_metrics((TOP / "metrics-2.txt").read_text(), at_s=110.0)
    return one, two


def test_the_recorded_expositions_are_what_the_proxy_writes_now() -> None:
    assert (TOP / "metrics-1.txt").read_text() == _proxy(FIRST, 0)
    assert (TOP / "metrics-2.txt").read_text() == _proxy(SECOND, 3)


def test_a_scrape_reads_answers_errors_latency_and_in_flight() -> None:
    _, two = _samples()
    assert two.requests == {"tiny-llama": 50.0, "qwen": 4.0}  # the 404 with no model is left out
    assert two.errors == {"tiny-llama": 2.0}
    assert two.latency["qwen"][2.5] == 4.0 and two.latency["qwen"][float("inf")] == 4.0
    assert two.in_flight == {"tiny-llama-0": 3.0, "tiny-llama-1": 0.0, "qwen-0": 0.0}


def test_rates_percentiles_and_in_flight_come_from_the_window() -> None:
    window = TrafficWindow(window_s=30.0)
    for sample in _samples():
        window.add(sample)
    qwen, tiny = window.traffic(MODELS)
    assert tiny.model == "tiny-llama" and tiny.requests_total == 50
    assert tiny.requests_per_s == pytest.approx(2.0)  # 20 in 10 s
    assert tiny.errors_per_s == pytest.approx(0.2)
    assert tiny.in_flight == 3 and tiny.window_s == 10.0
    # Of the window's 20: 18 at 0.2 s (bucket 0.1-0.25), 2 at 3 s (bucket 2.5-5).
    assert tiny.p50_s is not None and 0.1 < tiny.p50_s <= 0.25
    assert tiny.p99_s is not None and 2.5 < tiny.p99_s <= 5.0
    # qwen had no request in the window: no rate of latency to show, but its total.
    assert (qwen.requests_per_s, qwen.p50_s, qwen.requests_total) == (0.0, None, 4)


def test_one_sample_gives_totals_and_no_rates() -> None:
    window = TrafficWindow()
    window.add(_samples()[1])
    tiny = window.traffic(MODELS)[1]
    assert tiny.requests_total == 50 and tiny.requests_per_s is None and tiny.p99_s is None


def test_a_proxy_restart_counts_from_zero_not_negative() -> None:
    one, two = _samples()
    window = TrafficWindow()
    window.add(MetricsSample(at_s=90.0, requests=two.requests, latency=two.latency))
    window.add(MetricsSample(at_s=100.0, requests=one.requests, latency=one.latency))
    tiny = window.traffic(MODELS)[1]
    assert tiny.requests_per_s == pytest.approx(3.0)  # 30 since the restart, over 10 s
    assert tiny.p50_s is not None and tiny.p50_s > 0


def test_the_window_keeps_only_its_span() -> None:
    window = TrafficWindow(window_s=10.0)
    for at in (0.0, 4.0, 8.0, 12.0, 16.0):
        window.add(MetricsSample(at_s=at))
    # The oldest kept is the newest one at least 10 s old: the rates span the whole window.
    assert [s.at_s for s in window.samples] == [4.0, 8.0, 12.0, 16.0]
    window.add(MetricsSample(at_s=40.0))  # a long pause: the latest two remain
    assert [s.at_s for s in window.samples] == [16.0, 40.0]


def test_quantiles_interpolate_inside_buckets() -> None:
    inf = float("inf")
    assert quantile(0.5, {1.0: 0.0, 2.0: 10.0, inf: 10.0}) == pytest.approx(1.5)
    assert quantile(0.99, {1.0: 10.0, inf: 20.0}) == 1.0  # in +Inf: the highest bound
    assert quantile(0.5, {1.0: 0.0, inf: 0.0}) is None
    assert quantile(0.5, {}) is None


@pytest.mark.parametrize(
    "line",
    [
        'xhpc_proxy_requests_total{model="m",replica="m-0",status="200"} -1',
        'xhpc_proxy_requests_total{model="m",replica="m-0",status="200"} NaN',
        'xhpc_proxy_requests_total{model="m" 5',
        "xhpc_proxy_requests_total{model=m} 5",
        'xhpc_proxy_requests_total{model="' + "x" * 600 + '"} 5',
        'xhpc_proxy_requests_total_other{model="m"} 5',
        "xhpc_proxy_requests_total{} ",
    ],
)
def test_lines_that_are_not_well_formed_are_skipped(line: str) -> None:
    good = 'xhpc_proxy_requests_total{model="m",replica="m-0",status="200"} 7'
    assert parse_metrics(f"{line}\n{good}\n", 0.0).requests == {"m": 7.0}


def test_label_values_are_unescaped() -> None:
    text = 'xhpc_proxy_requests_total{model="a\\"b\\\\c",replica="r",status="503"} 2\n'
    sample = parse_metrics(text, 0.0)
    assert sample.requests == {'a"b\\c': 2.0} and sample.errors == {'a"b\\c': 2.0}


if __name__ == "__main__":  # pragma: no cover - run by hand to record the fixtures
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else TOP
    (out / "metrics-1.txt").write_text(_proxy(FIRST, 0))
    (out / "metrics-2.txt").write_text(_proxy(SECOND, 3))
