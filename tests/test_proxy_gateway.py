"""Component tests for the gateway's endpoints: request limits, embeddings, affinity over HTTP,
per-model policies, and /metrics parsed as Prometheus text."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from tests.proxy_fakes import Stack, assert_openai_error, chat, open_stack
from xhpc.proxy.metrics import Histogram, ProxyMetrics
from xhpc.proxy.routes.routing import Router
from xhpc.settings import ProxyConfig


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


# --- a small, strict reader of the Prometheus text format ---

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(
    text: str, kinds: frozenset[str] = frozenset({"counter", "gauge", "histogram"})
) -> Samples:
    """Every sample; fails on a malformed line, a sample without HELP/TYPE, a bad histogram, a
    family of a kind not in ``kinds``."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in kinds
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"malformed line {line!r}"
        name, labels_text, value = match.groups()
        labels: list[tuple[str, str]] = []
        pos = 0
        while labels_text and pos < len(labels_text):
            label = LABEL.match(labels_text, pos)
            assert label, f"malformed labels in {line!r}"
            labels.append((label.group(1), label.group(2)))
            pos = label.end()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample {name} has no TYPE"
        key = (name, frozenset(labels))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value.replace("+Inf", "inf"))
    for name, kind in types.items():
        if kind == "histogram":
            check_histogram(name, samples)
    return samples


def check_histogram(name: str, samples: Samples) -> None:
    series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = {}
    for (sample, labels), value in samples.items():
        if sample == name + "_bucket":
            le = dict(labels)["le"]
            rest = frozenset(kv for kv in labels if kv[0] != "le")
            series.setdefault(rest, []).append((float(le.replace("+Inf", "inf")), value))
    for labels, buckets in series.items():
        buckets.sort()
        counts = [n for _, n in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert buckets[-1][0] == float("inf")
        assert samples[(name + "_count", labels)] == counts[-1]
        assert (name + "_sum", labels) in samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# --- request limits and errors ---


async def test_oversized_body_is_413_openai_shaped(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(max_body_bytes=1024))
    engine = await stack.engine("a")
    stack.publish("a")
    status, _, body = await stack.post("/v1/chat/completions", chat(pad="x" * 4096))
    assert status == 413
    assert_openai_error(body, "request_too_large")
    assert "1024" in body["error"]["message"]
    assert engine.received == []
    status, _, _ = await stack.post("/v1/chat/completions", chat())  # the proxy still serves
    assert status == 200


async def test_errors_are_counted_without_unbounded_labels(stack: Stack) -> None:
    await stack.engine("a")
    stack.publish("a", models=("cold", "m"))
    for model in ("nope-1", "nope-2"):
        assert (await stack.post("/v1/chat/completions", chat(model)))[0] == 404
    assert (await stack.post("/v1/chat/completions", chat("cold")))[0] == 503
    assert (await stack.post("/v1/chat/completions", b"{"))[0] == 400
    samples = parse_metrics(await stack.metrics())
    requests = "xhpc_proxy_requests_total"
    assert value(samples, requests, model="", replica="", status="404") == 2  # not by name
    assert value(samples, requests, model="cold", replica="", status="503") == 1
    assert value(samples, requests, model="", replica="", status="400") == 1
    assert value(samples, "xhpc_proxy_ready_replicas", model="cold") == 0
    assert value(samples, "xhpc_proxy_ready_replicas", model="m") == 1


# --- endpoints ---


async def test_embeddings_are_forwarded_and_their_usage_counted(stack: Stack) -> None:
    engine = await stack.engine("a", "emb")
    stack.publish("a")
    status, _, body = await stack.post("/v1/embeddings", {"model": "emb", "input": ["ab", "c"]})
    assert status == 200
    assert [d["embedding"][2] for d in body["data"]] == [2.0, 1.0]
    assert engine.received == [{"model": "/models/emb", "input": ["ab", "c"]}]
    samples = parse_metrics(await stack.metrics())
    assert value(samples, "xhpc_proxy_tokens_total", model="emb", kind="prompt") == 8
    assert value(samples, "xhpc_proxy_tokens_total", model="emb", kind="completion") == 0


async def test_openai_sdk_embeddings(stack: Stack) -> None:
    openai = pytest.importorskip("openai")
    await stack.engine("a", "emb")
    stack.publish("a")
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    async with client:
        reply = await client.embeddings.create(model="emb", input="hello", encoding_format="float")
    assert reply.data[0].embedding == [0.25, -0.5, 5.0]


# --- routing policies over HTTP ---


async def replies(stack: Stack, bodies: list[dict[str, object]], **kw: str) -> list[str]:
    out = []
    for body in bodies:
        status, _, answer = await stack.post("/v1/chat/completions", body, headers=kw or None)
        assert status == 200
        out.append(answer["choices"][0]["message"]["content"].removeprefix("hello from "))
    return out


def conversation(system: str, turns: int) -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    return {"model": "m", "messages": messages}


async def test_affinity_keeps_a_prefix_on_one_replica_and_spreads_prefixes(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(routing="affinity", affinity_prefix_chars=64))
    for rid in "abcd":
        await stack.engine(rid)
    stack.publish(*"abcd")
    long_system = "You are a careful assistant for the physics lab. " * 4
    same = await replies(stack, [conversation(long_system, n) for n in range(1, 8)])
    assert len(set(same)) == 1  # every turn of the conversation on one replica
    spread = await replies(stack, [conversation(f"prompt {i}", 0) for i in range(40)])
    assert set(spread) == {"a", "b", "c", "d"}
    assert max(Counter(spread).values()) <= 20


async def test_affinity_by_session_header_and_user(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(routing="affinity"))
    for rid in "abcd":
        await stack.engine(rid)
    stack.publish(*"abcd")
    bodies = [chat(messages=[{"role": "user", "content": f"different {i}"}]) for i in range(8)]
    by_session = await replies(stack, bodies, **{"X-Session-Id": "s-1"})
    assert len(set(by_session)) == 1
    by_user = await replies(stack, [{**b, "user": "alice"} for b in bodies])
    assert len(set(by_user)) == 1
    sessions = [
        (await replies(stack, bodies[:1], **{"X-Session-Id": f"s-{i}"}))[0] for i in range(40)
    ]
    assert set(sessions) == {"a", "b", "c", "d"}


async def test_affinity_spills_a_hot_prefix_under_load(stack: Stack) -> None:
    await stack.start_proxy(config=ProxyConfig(routing="affinity"))
    engines = [await stack.engine(rid) for rid in "ab"]
    hold = asyncio.Event()
    for engine in engines:
        engine.hold = hold
    stack.publish("a", "b")
    tasks = [asyncio.create_task(stack.post("/v1/chat/completions", chat())) for _ in range(8)]
    async with asyncio.timeout(5):
        while sum(len(e.received) for e in engines) < 8:
            await asyncio.sleep(0.01)
    counts = sorted(len(e.received) for e in engines)
    assert counts[0] >= 3  # ceil(1.25 * 8 / 2) = 5 at most on the hot replica
    hold.set()
    assert {r[0] for r in await asyncio.gather(*tasks)} == {200}


async def test_round_robin_per_model(stack: Stack) -> None:
    config = ProxyConfig(model_routing={"m": "round-robin"})
    await stack.start_proxy(config=config)
    slow = await stack.engine("a")
    await stack.engine("b")
    slow.hold = asyncio.Event()
    stack.publish("a", "b")
    first = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
    async with asyncio.timeout(5):
        while not slow.received:
            await asyncio.sleep(0.01)
    # round robin sends the second request to b and the third to the busy a
    assert await replies(stack, [chat()]) == ["b"]
    third = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
    async with asyncio.timeout(5):
        while len(slow.received) < 2:
            await asyncio.sleep(0.01)
    slow.hold.set()
    assert (await first)[0] == (await third)[0] == 200


# --- metrics ---


async def test_metrics_count_requests_latency_ttft_tokens_and_in_flight(stack: Stack) -> None:
    slow = await stack.engine("a")
    await stack.engine("b")
    stack.publish("a", "b")
    for _ in range(4):
        assert (await stack.post("/v1/chat/completions", chat()))[0] == 200
    status, _ = await stack.stream(chat(stream=True))
    assert status == 200
    slow.hold = asyncio.Event()
    stack.router.acquire(stack.routes["b"])
    held = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
    async with asyncio.timeout(5):
        while stack.router.outstanding("a") == 0:
            await asyncio.sleep(0.01)
    samples = parse_metrics(await stack.metrics())
    total = sum(v for (n, labels), v in samples.items() if n == "xhpc_proxy_requests_total")
    assert total == 5
    assert value(samples, "xhpc_proxy_request_duration_seconds_count", model="m") == 5
    assert value(samples, "xhpc_proxy_ttft_seconds_count", model="m") == 1
    # four answers of 3 + 3 tokens, and the stream's 3 + 2 (the proxy asks every stream's usage)
    assert value(samples, "xhpc_proxy_tokens_total", model="m", kind="prompt") == 15
    assert value(samples, "xhpc_proxy_tokens_total", model="m", kind="completion") == 14
    assert value(samples, "xhpc_proxy_in_flight", replica="a") == 1
    assert value(samples, "xhpc_proxy_in_flight", replica="b") == 1
    assert value(samples, "xhpc_proxy_breaker_state", replica="a") == 0
    slow.hold.set()
    assert (await held)[0] == 200
    stack.router.release(stack.routes["b"])
    samples = parse_metrics(await stack.metrics())
    assert value(samples, "xhpc_proxy_in_flight", replica="a") == 0


def test_metrics_text_escapes_labels_and_renders_histograms() -> None:
    metrics = ProxyMetrics()
    metrics.request('we"ird\\mo\ndel', "r-1", 200, 0.003)
    metrics.request("m", "r-1", 200, 1e9)
    metrics.ttft.observe(("m",), 0.0)
    samples = parse_metrics(metrics.render(Router()))
    labels = {"model": 'we\\"ird\\\\mo\\ndel', "replica": "r-1", "status": "200"}
    assert value(samples, "xhpc_proxy_requests_total", **labels) == 1
    assert value(samples, "xhpc_proxy_request_duration_seconds_bucket", model="m", le="+Inf") == 1
    assert value(samples, "xhpc_proxy_request_duration_seconds_bucket", model="m", le="600") == 0
    assert value(samples, "xhpc_proxy_ttft_seconds_bucket", model="m", le="0.005") == 1


def test_histogram_bucket_bounds_are_inclusive() -> None:
    hist = Histogram("h", "help", ("k",), (0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 2.0):
        hist.observe(("x",), v)
    lines = hist.render()
    assert 'h_bucket{k="x",le="0.1"} 1' in lines
    assert 'h_bucket{k="x",le="1"} 3' in lines
    assert 'h_bucket{k="x",le="+Inf"} 4' in lines
    assert 'h_sum{k="x"} 3.6' in lines


def test_public_api_of_the_proxy_package() -> None:
    import xhpc.proxy

    assert sorted(xhpc.proxy.__all__) == sorted(
        [
            "METRICS_KEY",
            "ROUTER_KEY",
            "BrokerRouteSource",
            "NoReadyReplicaError",
            "ProxyMetrics",
            "RequestInfo",
            "Router",
            "UnknownModelError",
            "Upstream",
            "UpstreamFactory",
            "aiohttp_upstream",
            "bound_url",
            "make_app",
            "run_proxy",
        ]
    )
    for name in xhpc.proxy.__all__:
        assert getattr(xhpc.proxy, name) is not None
