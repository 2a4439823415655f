"""The two-phase prefill -> decode route (xhpc.proxy.pd): a real proxy on loopback in front of
fake prefill and decode engines that check vLLM's NIXL request protocol on every request
(tests/pd_fakes.py). No Slurm."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.pd_fakes import PREFILL_REQUEST_PARAMS, PdStack, open_pd_stack
from tests.proxy_fakes import assert_openai_error, chat, eventually
from tests.test_proxy_gateway import parse_metrics, value
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.models import PdRole, Route, RoutingTable
from xhpc.proxy.pd import decode_body, kv_params_of, prefill_body, request_id
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.tenants.keys import KeyBook
from xhpc.settings import ProxyConfig


@pytest.fixture
async def pd() -> AsyncIterator[PdStack]:
    async with open_pd_stack() as s:
        yield s


async def one_by_one(s: PdStack) -> PdStack:
    await s.prefill("p1")
    await s.decode("d1")
    s.publish("p1", "d1")
    return s


def without_params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def events(raw: bytes) -> list[str]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if lines:
            out.append("\n".join(lines))
    return out


# --- the protocol, leg by leg ---


async def test_chat_goes_prefill_then_decode_with_the_params_unchanged(pd: PdStack) -> None:
    await one_by_one(pd)
    p, d = pd.prefills["p1"], pd.decodes["d1"]
    body = chat("pd", max_tokens=20, max_completion_tokens=20, min_tokens=2, temperature=0, seed=7)
    status, _, answer = await pd.post(body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "hello from d1"
    assert pd.violations() == []
    # The prefill leg: the client's body with stream false, one token and the request shape.
    (sent_p,) = p.received
    assert sent_p["stream"] is False
    assert sent_p["max_tokens"] == 1 and sent_p["max_completion_tokens"] == 1
    assert "min_tokens" not in sent_p
    assert sent_p["kv_transfer_params"] == PREFILL_REQUEST_PARAMS
    assert sent_p["messages"] == body["messages"] and sent_p["seed"] == 7
    # The decode leg: the client's original body plus exactly what the prefill returned.
    (sent_d,) = d.received
    (rid,) = p.request_ids
    assert rid is not None and d.request_ids == [rid]
    assert sent_d["kv_transfer_params"] == pd.ledger.issued[rid]
    assert without_params(sent_d) == {**body, "model": "/models/pd"}
    assert [role for role, _, _ in pd.ledger.legs] == ["prefill", "decode"]


async def test_streamed_chat_relays_the_decode_stream_byte_exact(pd: PdStack) -> None:
    await one_by_one(pd)
    body = chat("pd", stream=True, stream_options={"include_usage": True}, max_tokens=5)
    status, raw = await pd.stream(body)
    assert status == 200
    # byte-exact, the model named by its public name, and it ended with [DONE]
    assert raw == pd.decodes["d1"].sent.replace(b'"/models/pd"', b'"pd"')
    assert b"/models/pd" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    assert pd.violations() == []
    (sent_p,) = pd.prefills["p1"].received
    assert sent_p["stream"] is False and "stream_options" not in sent_p
    (sent_d,) = pd.decodes["d1"].received
    assert without_params(sent_d) == {**body, "model": "/models/pd"}
    assert sent_d["stream"] is True and sent_d["stream_options"] == {"include_usage": True}


async def test_completions_streamed_and_not(pd: PdStack) -> None:
    await one_by_one(pd)
    body = {"model": "pd", "prompt": "Once upon a time", "max_tokens": 8}
    status, _, answer = await pd.post(body, "/v1/completions")
    assert status == 200
    assert answer["choices"][0]["text"] == "text from d1"
    status, raw = await pd.stream({**body, "stream": True}, "/v1/completions")
    assert status == 200
    assert [e for e in events(raw)][-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events(raw)[:-1]) == "text"
    assert pd.violations() == []
    assert len(pd.prefills["p1"].received) == len(pd.decodes["d1"].received) == 2
    assert pd.prefills["p1"].received[1]["prompt"] == "Once upon a time"


@pytest.mark.parametrize("mode", ["absent", "null"])
async def test_example_connector_prefill_then_decode_without_params(pd: PdStack, mode: str) -> None:
    await one_by_one(pd)
    pd.prefills["p1"].params = mode  # type: ignore[assignment]
    for body in (chat("pd"), chat("pd", stream=True)):
        if body.get("stream"):
            status, raw = await pd.stream(body)
            assert raw.endswith(b"data: [DONE]\n\n")
        else:
            status, _, _ = await pd.post(body)
        assert status == 200
    assert pd.violations() == []
    for sent in pd.decodes["d1"].received:
        assert "kv_transfer_params" not in sent
    assert [r for r, _, _ in pd.ledger.legs] == ["prefill", "decode"] * 2
    samples = parse_metrics(await pd.stack.metrics())
    assert value(samples, "xhpc_proxy_pd_handoffs_total", model="pd", kv_params="false") == 2
    assert not any(name == "xhpc_proxy_pd_transfer_failures_total" for name, _ in samples)


async def test_one_request_id_on_both_legs(pd: PdStack) -> None:
    await one_by_one(pd)
    await pd.post(chat("pd"), headers={"X-Request-Id": "client-req-42"})
    assert pd.prefills["p1"].request_ids == ["client-req-42"]
    assert pd.decodes["d1"].request_ids == ["client-req-42"]
    # None sent, or one that is not a plain token: a new one per request.
    await pd.post(chat("pd"))
    await pd.post(chat("pd"), headers={"X-Request-Id": "a b\tc"})
    generated = pd.prefills["p1"].request_ids[1:]
    assert pd.decodes["d1"].request_ids[1:] == generated
    assert len(set(generated)) == 2 and all(r and r.startswith("xhpc-") for r in generated)
    assert pd.violations() == []


async def test_a_clients_own_kv_transfer_params_never_reach_an_engine(pd: PdStack) -> None:
    await one_by_one(pd)
    forged = {"remote_engine_id": "someone-else", "remote_block_ids": [1, 2, 3]}
    status, _, _ = await pd.post(chat("pd", kv_transfer_params=forged))
    assert status == 200
    assert pd.violations() == []  # the prefill got the request shape, the decode P's params
    pd.prefills["p1"].params = "absent"
    status, _, _ = await pd.post(chat("pd", kv_transfer_params=forged))
    assert status == 200
    assert "kv_transfer_params" not in pd.decodes["d1"].received[-1]


async def test_embeddings_on_a_pd_model_is_400(pd: PdStack) -> None:
    await one_by_one(pd)
    status, _, body = await pd.post({"model": "pd", "input": "x"}, "/v1/embeddings")
    assert status == 400
    assert_openai_error(body, "unsupported_endpoint")
    assert pd.ledger.legs == []


async def test_a_missing_half_is_503_before_anything_is_sent(pd: PdStack) -> None:
    await pd.prefill("p1")
    await pd.decode("d1")
    pd.publish("p1")
    status, headers, body = await pd.post(chat("pd"))
    assert status == 503
    assert_openai_error(body, "no_ready_replica")
    assert "decode instance" in body["error"]["message"]
    assert "Retry-After" in headers
    pd.publish("d1")
    status, _, body = await pd.post(chat("pd"))
    assert status == 503
    assert "prefill instance" in body["error"]["message"]
    assert pd.ledger.legs == []


async def test_plain_models_beside_a_pd_model_keep_the_single_phase_route(pd: PdStack) -> None:
    await one_by_one(pd)
    plain = await pd.stack.engine("a", "m")
    pd.publish("p1", "d1", "a")
    status, _, answer = await pd.post(chat("m"))
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "hello from a"
    assert "kv_transfer_params" not in plain.received[0]
    assert pd.ledger.legs == []


# --- errors and retries ---


async def test_a_dead_prefill_instance_costs_no_request(pd: PdStack) -> None:
    pd.dead("p0", PdRole.PREFILL)
    await pd.prefill("p1")
    await pd.decode("d1")
    pd.publish("p0", "p1", "d1")
    for i in range(12):  # sequential; affinity spreads the prompts over both instances
        body = chat("pd", messages=[{"role": "user", "content": f"prompt {i}"}])
        if i % 2:
            status, raw = await pd.stream({**body, "stream": True})
            assert raw.endswith(b"data: [DONE]\n\n")
        else:
            status, _, _ = await pd.post(body)
        assert status == 200
    results = await asyncio.gather(*(pd.post(chat("pd")) for _ in range(10)))
    assert [r[0] for r in results] == [200] * 10
    assert pd.violations() == []
    assert len(pd.decodes["d1"].received) == 22
    samples = parse_metrics(await pd.stack.metrics())
    assert value(samples, "xhpc_proxy_retries_total", model="pd", reason="prefill_connect_error")
    failed = value(
        samples, "xhpc_proxy_pd_transfer_failures_total", model="pd", kind="prefill_failed"
    )
    assert failed >= 1
    assert value(samples, "xhpc_proxy_breaker_state", replica="p0") == 1  # ejected


async def test_a_prefill_5xx_is_retried_on_another_instance(pd: PdStack) -> None:
    sick = await pd.prefill("p1")
    await pd.prefill("p2")
    await pd.decode("d1")
    sick.status = 500
    pd.publish("p1", "p2", "d1")
    for _ in range(4):
        status, _, _ = await pd.post(chat("pd"))  # one prompt: affinity sends it to one P
        assert status == 200
    assert pd.violations() == []
    assert len(pd.prefills["p2"].received) == 4
    # With no other prefill instance, the engine's own error is the answer.
    pd.publish("p1", "d1")
    status, _, body = await pd.post(chat("pd"))
    assert status == 500
    assert body["error"]["message"] == "error at p1"
    assert len(pd.decodes["d1"].received) == 4


async def test_a_prefill_4xx_is_the_clients_and_is_not_retried(pd: PdStack) -> None:
    await pd.prefill("p1")
    await pd.prefill("p2")
    await pd.decode("d1")
    pd.publish("p1", "p2", "d1")
    for p in pd.prefills.values():
        p.status = 400
    status, _, body = await pd.post(chat("pd"))
    assert status == 400
    assert body["error"]["message"].startswith("error at p")
    assert sum(len(p.received) for p in pd.prefills.values()) == 1
    assert pd.decodes["d1"].received == []


async def test_prefill_retries_stop_at_max_retries() -> None:
    async with open_pd_stack(ProxyConfig(max_retries=0)) as s:
        s.dead("p0", PdRole.PREFILL)
        await s.decode("d1")
        s.publish("p0", "d1")
        status, _, body = await s.post(chat("pd"))
        assert status == 502
        assert_openai_error(body, "upstream_unreachable")
        assert s.decodes["d1"].received == []


async def test_a_prefill_that_does_not_answer_in_time_is_504_not_retried() -> None:
    async with open_pd_stack(upstream_timeout_s=0.3) as s:
        slow = await s.prefill("p1")
        await s.prefill("p2")
        await s.decode("d1")
        s.publish("p1", "p2", "d1")
        for p in s.prefills.values():
            p.hold = asyncio.Event()
        try:
            status, _, body = await s.post(chat("pd"))
        finally:
            for p in s.prefills.values():
                assert p.hold is not None
                p.hold.set()
        assert status == 504
        assert_openai_error(body, "upstream_timeout")
        assert len(slow.received) + len(s.prefills["p2"].received) == 1  # the engine may be busy
        assert s.decodes["d1"].received == []
        samples = parse_metrics(await s.stack.metrics())
        kind = "prefill_failed"
        assert value(samples, "xhpc_proxy_pd_transfer_failures_total", model="pd", kind=kind) == 1
        assert value(samples, "xhpc_proxy_in_flight", replica="d1") == 0


async def test_an_unreachable_decode_is_retried_with_the_same_params(pd: PdStack) -> None:
    """The request never reached the dead D, so P still holds the blocks: no new prefill."""
    await pd.prefill("p1")
    pd.dead("d0", PdRole.DECODE)
    await pd.decode("d1")
    pd.publish("p1", "d0", "d1")
    for stream in (False, True, False, True):
        body = chat("pd", stream=stream)
        status = (await pd.stream(body))[0] if stream else (await pd.post(body))[0]
        assert status == 200
    assert pd.violations() == []
    assert len(pd.prefills["p1"].received) == 4  # one prefill leg per request
    assert len(pd.decodes["d1"].received) == 4
    samples = parse_metrics(await pd.stack.metrics())
    assert value(samples, "xhpc_proxy_retries_total", model="pd", reason="decode_connect_error")
    assert value(samples, "xhpc_proxy_pd_transfer_failures_total", model="pd", kind="decode_failed")


async def test_a_failed_decode_gets_a_new_prefill_on_another_instance(pd: PdStack) -> None:
    """D answered 500 (vLLM does when the P it fetches from is gone): the blocks may be lost,
    so the retry prefills again, on the other P, and the new D gets the new params."""
    await pd.prefill("p1")
    await pd.prefill("p2")
    sick = await pd.decode("d1")
    await pd.decode("d2")
    sick.status = 500
    pd.publish("p1", "p2", "d1", "d2")
    statuses = [(await pd.post(chat("pd", user=f"u{i}")))[0] for i in range(4)]
    assert statuses == [200] * 4
    assert pd.violations() == []
    assert len(pd.decodes["d2"].received) == 4
    prefilled = pd.ledger.rids("prefill")
    retried = sorted({rid for rid in prefilled if prefilled.count(rid) == 2})
    assert retried  # least outstanding sends some first decode legs to d1
    for rid in retried:
        prefills = [name for role, name, r in pd.ledger.legs if role == "prefill" and r == rid]
        assert len(set(prefills)) == 2  # the new prefill leg went to the other instance
        (sent,) = [
            b
            for b, r in zip(pd.decodes["d2"].received, pd.decodes["d2"].request_ids, strict=True)
            if r == rid
        ]
        assert sent["kv_transfer_params"] == pd.ledger.issued[rid]
        assert sent["kv_transfer_params"]["remote_engine_id"] == f"engine-{prefills[1]}"


async def test_without_params_a_decode_retry_needs_no_new_prefill(pd: PdStack) -> None:
    p = await pd.prefill("p1")
    p.params = "absent"  # ExampleConnector: the KV is in shared storage
    sick = await pd.decode("d1")
    await pd.decode("d2")
    sick.status = 503
    pd.publish("p1", "d1", "d2")
    for _ in range(4):
        assert (await pd.post(chat("pd")))[0] == 200
    assert len(p.received) == 4
    assert pd.violations() == []


async def test_a_decode_stream_that_breaks_after_its_first_event_ends_well_formed(
    pd: PdStack,
) -> None:
    await pd.prefill("p1")
    d1 = await pd.decode("d1")
    d2 = await pd.decode("d2")
    pd.publish("p1", "d1", "d2")
    for d in (d1, d2):
        d.break_after = 1
    status, raw = await pd.stream(chat("pd", stream=True))
    assert status == 200
    data = events(raw)
    assert json.loads(data[0])["choices"][0]["delta"]["content"] == "Hel"
    assert_openai_error(json.loads(data[-1]), "upstream_stream_broken")
    assert "[DONE]" not in data and raw.endswith(b"\n\n")  # cut: not a whole answer
    assert len(d1.received) + len(d2.received) == 1  # never retried after the first byte
    samples = parse_metrics(await pd.stack.metrics())
    failed = value(
        samples, "xhpc_proxy_pd_transfer_failures_total", model="pd", kind="decode_failed"
    )
    assert failed == 1


async def test_an_aborted_decode_answer_is_a_failed_leg_and_is_retried(pd: PdStack) -> None:
    """vLLM answers a request it aborted (its KV never arrived, its engine stopped) with a 200
    and no answer: for a whole answer that is a failed decode leg, prefilled again and sent to
    the other decode instance; the client gets the whole answer."""
    await pd.prefill("p1")
    sick = await pd.decode("d1")
    well = await pd.decode("d2")
    sick.aborts = True
    pd.publish("p1", "d1", "d2")
    for i in range(4):
        status, _, body = await pd.post(chat("pd", user=f"u{i}"))
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == "hello from d2"
    assert pd.violations() == []
    assert len(well.received) == 4
    retried = len(sick.received)
    assert retried >= 1  # least outstanding sends some first decode legs to d1
    assert len(pd.ledger.rids("prefill")) == 4 + retried  # each retry prefilled again
    samples = parse_metrics(await pd.stack.metrics())
    assert value(samples, "xhpc_proxy_retries_total", model="pd", reason="decode_unfinished")


async def test_an_aborted_decode_with_no_other_instance_is_a_502(pd: PdStack) -> None:
    await pd.prefill("p1")
    sick = await pd.decode("d1")
    sick.aborts = True
    pd.publish("p1", "d1")
    status, _, body = await pd.post(chat("pd"))
    assert status == 502
    assert_openai_error(body, "upstream_bad_answer")
    assert "unfinished (abort)" in body["error"]["message"]


async def test_an_aborted_decode_stream_ends_with_an_error_event_not_done(pd: PdStack) -> None:
    """Streamed, the client already has the role chunk: the stream ends with an error event in
    place of the engine's [DONE], never as a 200 that looks whole."""
    await pd.prefill("p1")
    sick = await pd.decode("d1")
    sick.aborts = True
    pd.publish("p1", "d1")
    status, raw = await pd.stream(chat("pd", stream=True))
    assert status == 200
    data = events(raw)
    assert json.loads(data[0])["choices"][0]["delta"]["role"] == "assistant"
    assert_openai_error(json.loads(data[-1]), "upstream_unfinished")
    assert "[DONE]" not in data
    samples = parse_metrics(await pd.stack.metrics())
    assert value(
        samples, "xhpc_proxy_stream_errors_total", model="pd", replica="d1", kind="unfinished"
    )


# --- policies per role ---


async def test_policies_per_role() -> None:
    config = ProxyConfig(pd_prefill_routing="round-robin", pd_decode_routing="least-outstanding")
    async with open_pd_stack(config) as s:
        for rid in ("p1", "p2", "p3"):
            await s.prefill(rid)
        held = await s.decode("d1")
        await s.decode("d2")
        s.publish("p1", "p2", "p3", "d1", "d2")
        held.hold = asyncio.Event()
        first = asyncio.create_task(s.post(chat("pd")))
        try:
            await eventually(lambda: len(held.received) == 1)
            for _ in range(5):  # d1 holds a request: least outstanding sends these to d2
                assert (await s.post(chat("pd")))[0] == 200
        finally:
            held.hold.set()
        assert (await first)[0] == 200
        assert len(s.decodes["d2"].received) == 5
        prefills = [name for role, name, _ in s.ledger.legs if role == "prefill"]
        assert prefills == ["p1", "p2", "p3", "p1", "p2", "p3"]  # round robin, whatever the load
        assert s.violations() == []


async def test_prefill_affinity_by_default_keeps_a_prefix_on_one_instance(pd: PdStack) -> None:
    for rid in ("p1", "p2", "p3", "p4"):
        await pd.prefill(rid)
    await pd.decode("d1")
    await pd.decode("d2")
    pd.publish("p1", "p2", "p3", "p4", "d1", "d2")
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    for turn in range(4):
        messages = [system, {"role": "user", "content": f"turn {turn}"}]
        assert (await pd.post(chat("pd", messages=messages)))[0] == 200
    by_instance = Counter(name for role, name, _ in pd.ledger.legs if role == "prefill")
    assert len(by_instance) == 1  # one conversation, one prefill instance (its prefix cache)
    decodes = Counter(name for role, name, _ in pd.ledger.legs if role == "decode")
    assert set(decodes) == {"d1", "d2"}  # decode: least outstanding, ties rotate
    for i in range(20):
        assert (await pd.post(chat("pd", user=f"user-{i}")))[0] == 200
    by_instance = Counter(name for role, name, _ in pd.ledger.legs if role == "prefill")
    assert len(by_instance) >= 3  # different users spread


def test_router_picks_by_role_with_each_roles_policy() -> None:
    def route(rid: str, role: PdRole | None, model: str = "pd") -> Route:
        return Route(
            model=model, replica_id=rid, url="http://x.invalid", served_model="s", role=role
        )

    routes = (
        route("p1", PdRole.PREFILL),
        route("p2", PdRole.PREFILL),
        route("d1", PdRole.DECODE),
        route("a", None, "m"),
    )
    config = ProxyConfig(pd_prefill_routing="round-robin", pd_decode_routing="round-robin")
    router = Router(RoutingTable(version=1, models=("m", "pd"), routes=routes), config=config)
    assert router.is_pd("pd") and not router.is_pd("m") and not router.is_pd("nope")
    picks = [router.pick("pd", role=PdRole.PREFILL).replica_id for _ in range(4)]
    assert picks == ["p1", "p2", "p1", "p2"]
    assert router.pick("pd", role=PdRole.DECODE).replica_id == "d1"
    assert router.policy("pd", PdRole.PREFILL).name == "round-robin"
    assert router.pick("m").replica_id == "a"
    router.update(RoutingTable(version=2, models=("m", "pd"), routes=routes[3:]))
    assert not router.is_pd("pd")  # no instance left: a model with no route


# --- metrics, secrets, keys ---


async def test_metrics_per_leg(pd: PdStack) -> None:
    await one_by_one(pd)
    assert (await pd.post(chat("pd")))[0] == 200
    assert (await pd.stream(chat("pd", stream=True)))[0] == 200
    samples = parse_metrics(await pd.stack.metrics())
    for role, replica in (("prefill", "p1"), ("decode", "d1")):
        legs = value(
            samples,
            "xhpc_proxy_pd_legs_total",
            model="pd",
            role=role,
            replica=replica,
            outcome="200",
        )
        assert legs == 2
    assert value(samples, "xhpc_proxy_pd_prefill_seconds_count", model="pd") == 2
    assert value(samples, "xhpc_proxy_pd_decode_ttft_seconds_count", model="pd") == 1  # streams
    assert value(samples, "xhpc_proxy_pd_handoffs_total", model="pd", kv_params="true") == 2
    assert value(samples, "xhpc_proxy_requests_total", model="pd", replica="d1", status="200") == 2
    assert value(samples, "xhpc_proxy_in_flight", replica="d1") == 0
    assert value(samples, "xhpc_proxy_in_flight", replica="p1") == 0


async def test_each_leg_carries_its_own_instances_secret(pd: PdStack) -> None:
    await pd.prefill("p1", secret="p-secret")
    await pd.decode("d1", secret="d-secret")
    pd.publish("p1", "d1")
    assert (await pd.post(chat("pd"), headers={"Authorization": "Bearer client"}))[0] == 200
    assert (await pd.stream(chat("pd", stream=True)))[0] == 200
    assert pd.prefills["p1"].authorization == ["Bearer p-secret"] * 2
    assert pd.decodes["d1"].authorization == ["Bearer d-secret"] * 2


async def test_api_keys_are_enforced_and_usage_counted() -> None:
    key_id, key, digest = new_key()
    book = KeyBook()
    grant = KeyGrant(key_id=key_id, digest=digest, user="alice", account="lab1")
    book.update(Grants(keys=(grant,), access=(ModelAccess(model="pd", owner="alice"),)))
    async with open_pd_stack(keys=book) as s:
        await one_by_one(s)
        status, _, body = await s.post(chat("pd"))
        assert status == 401
        assert_openai_error(body, "invalid_api_key")
        assert s.ledger.legs == []
        auth = {"Authorization": f"Bearer {key}"}
        status, _, body = await s.post(chat("pd"), headers=auth)
        assert status == 200
        report = book.take_report("p")
        usage = report.usage[key_id]["pd"]
        assert usage.requests == 1
        # The decode's usage is the client's (the prefill leg's single token is not billed).
        assert (usage.prompt_tokens, usage.completion_tokens) == (3, 3)


# --- the pure parts ---


def test_prefill_and_decode_bodies() -> None:
    body = {
        "model": "pd",
        "prompt": "p",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "min_tokens": 3,
        "kv_transfer_params": {"remote_engine_id": "forged"},
    }
    p = prefill_body(body)
    assert p == {
        "model": "pd",
        "prompt": "p",
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_REQUEST_PARAMS,
    }
    assert "max_completion_tokens" not in p
    assert body["stream"] is True and body["max_tokens"] == 9  # the client's body is unchanged
    params = {"remote_engine_id": "e", "remote_block_ids": [1]}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in decode_body(body, None)


def test_kv_params_of_a_prefill_answer() -> None:
    assert kv_params_of(b'{"choices": [], "kv_transfer_params": {"a": [1, 2]}}') == {"a": [1, 2]}
    assert kv_params_of(b'{"choices": []}') is None
    assert kv_params_of(b'{"kv_transfer_params": null}') is None
    for bad in (b"[1]", b"not json", b'{"kv_transfer_params": 3}'):
        with pytest.raises(ValueError):
            kv_params_of(bad)


def test_request_ids() -> None:
    assert request_id("abc-1.2:3_x") == "abc-1.2:3_x"
    for hostile in (None, "", "a b", "x" * 129, "a\nb", "é"):
        rid = request_id(hostile)
        assert rid.startswith("xhpc-") and len(rid) == 37
    assert request_id(None) != request_id(None)
