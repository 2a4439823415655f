"""Calls held through a cold start (``xhpc.proxy.routes.holding``), before fake engines on
loopback: a call for an autoscaled model with no READY replica waits for one and is answered
once, by it; a caller that allows less than the estimate, a model that cannot be woken and one
call too many each get a 503 with Retry-After at once; a held stream is kept open with SSE
comments and ends with an error event if its wait runs out; a call whose routes were all lost
before it reached an engine waits for a new route (held once, in all)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from tests.proxy_fakes import Stack, assert_openai_error, chat, open_stack
from xhpc.clock import utcnow
from xhpc.gateway_settings import ProxyConfig
from xhpc.models import RoutingTable, Waking

CONFIG = ProxyConfig(auth="none", hold_s=5.0, hold_per_model=2, hold_keepalive_s=0.1)


def asleep(stack: Stack, **waking: Waking) -> None:
    """The table lists the model with no route, waking."""
    version = stack.router.table.version + 1
    stack.router.update(RoutingTable(version=version, models=("m",), waking=waking))


async def test_a_held_call_is_answered_once_by_the_first_ready_replica() -> None:
    async with open_stack(CONFIG) as stack:
        engine = await stack.engine("m-0")
        asleep(stack, m=Waking(lead_s=2.0))
        call = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        await asyncio.sleep(0.3)
        assert not call.done()  # held, not refused
        assert stack.router.demand()[2] == {"m": 1}  # reported as held now
        stack.publish("m-0")  # READY: in the table
        status, _, body = await asyncio.wait_for(call, 5)
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert len(engine.received) == 1  # sent once
        # one call, one of demand: held while it waited (a level), begun once sent; not counted
        # as a call that found no replica (only a refused one is)
        assert stack.router.demand() == ({"m": 1}, {}, {})


async def test_a_caller_that_allows_less_than_the_estimate_gets_503_at_once() -> None:
    async with open_stack(CONFIG) as stack:
        asleep(stack, m=Waking(lead_s=30.0, notice_s=2.0))
        status, headers, body = await stack.post(
            "/v1/chat/completions", chat(), headers={"X-Xhpc-Max-Wait": "1"}
        )
        assert status == 503 and int(headers["Retry-After"]) >= 30
        assert_openai_error(body, "model_waking")
        # asleep: + the gateway's sync (1 s) and the broker's pass (2 s), before the wake begins
        assert "about 33 s" in body["error"]["message"]
        # over the gateway's own longest hold, too
        status, headers, _ = await stack.post("/v1/chat/completions", chat())
        assert status == 503 and int(headers["Retry-After"]) >= 30
        started = Waking(since=utcnow() - timedelta(seconds=28), lead_s=30.0)
        asleep(stack, m=started)  # its wake began 28 s ago: about 2 s left
        call = asyncio.create_task(
            stack.post("/v1/chat/completions", chat(), headers={"X-Xhpc-Max-Wait": "4"})
        )
        await asyncio.sleep(0.2)
        assert not call.done()
        await stack.engine("m-0")
        stack.publish("m-0")
        assert (await asyncio.wait_for(call, 5))[0] == 200


async def test_a_wake_that_fails_answers_the_held_calls_at_once() -> None:
    async with open_stack(CONFIG) as stack:
        asleep(stack, m=Waking(lead_s=2.0))
        held = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        await asyncio.sleep(0.2)
        assert not held.done()
        asleep(stack, m=Waking(lead_s=2.0, failed="QOSMaxGRESPerUser"))
        status, headers, body = await asyncio.wait_for(held, 2)
        assert status == 503 and "Retry-After" in headers
        assert_openai_error(body, "wake_failed")
        assert "QOSMaxGRESPerUser" in body["error"]["message"]
        status, _, body = await stack.post("/v1/chat/completions", chat())
        assert status == 503
        assert_openai_error(body, "wake_failed")
        assert stack.router.demand()[1] == {"m": 1}  # the call refused at once: for a wake


async def test_one_call_too_many_is_refused_with_the_estimate() -> None:
    async with open_stack(CONFIG) as stack:
        asleep(stack, m=Waking(lead_s=2.0))
        held = [asyncio.create_task(stack.post("/v1/chat/completions", chat())) for _ in range(2)]
        await asyncio.sleep(0.3)
        status, headers, body = await stack.post("/v1/chat/completions", chat())
        assert status == 503 and int(headers["Retry-After"]) >= 2
        assert_openai_error(body, "too_many_held")
        await stack.engine("m-0")
        stack.publish("m-0")
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]


async def test_a_held_stream_is_kept_open_then_relayed_or_ended_with_an_error_event() -> None:
    async with open_stack(CONFIG) as stack:
        asleep(stack, m=Waking(lead_s=1.0))
        call = asyncio.create_task(stack.stream(chat(stream=True)))
        await asyncio.sleep(0.5)
        await stack.engine("m-0")
        stack.publish("m-0")
        status, raw = await asyncio.wait_for(call, 5)
        assert status == 200
        assert raw.startswith(b": waiting for a replica of m")
        assert b": a replica of m is ready (held " in raw  # the hold's end, before the data
        assert raw.index(b"is ready (held") < raw.index(b"data:")
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"content"' in raw

    quick = CONFIG.model_copy(update={"hold_s": 0.6, "refresh_interval_s": 0.05})
    async with open_stack(quick) as stack:
        asleep(stack, m=Waking(lead_s=0.5))
        status, raw = await stack.stream(chat(stream=True))
        assert status == 200 and raw.startswith(b": waiting")
        assert b'"code": "model_waking"' in raw and b"[DONE]" not in raw


async def test_a_call_whose_routes_are_all_lost_waits_for_a_new_one_and_is_answered_once() -> None:
    """An autoscaled model's only route is lost (its node failed while the deployment scaled
    down): a call that reached no engine is held, not refused, until the broker's replacement
    is in the table; then it is answered once, by it. A model that is not autoscaled gets its
    503 as before."""
    async with open_stack(CONFIG) as stack:
        wake = {"m": Waking(lead_s=2.0)}
        stack.dead("m-0")  # refuses connections: nothing reaches an engine
        stack.publish("m-0", waking=wake)
        plain = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        streamed = asyncio.create_task(stack.stream(chat(stream=True)))
        await asyncio.sleep(0.5)
        assert not plain.done() and not streamed.done()  # held, not refused
        assert stack.router.demand()[2] == {"m": 2}  # held: demand the broker hears of
        engine = await stack.engine("m-1")
        stack.publish("m-1", waking=wake)  # the replacement READY
        status, _, body = await asyncio.wait_for(plain, 5)
        assert status == 200 and body["choices"][0]["message"]["content"], body
        status, raw = await asyncio.wait_for(streamed, 5)
        assert status == 200 and raw.startswith(b": waiting for a replica of m"), raw[:80]
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"content"' in raw
        assert len(engine.received) == 2  # each sent once

        # The lost route back in the table beside the new one: a call tries it, fails to
        # connect, and goes on to the other at once (no hold).
        stack.publish("m-0", "m-1", waking=wake)
        for _ in range(3):
            assert (await stack.post("/v1/chat/completions", chat()))[0] == 200

        # Re-planned: the same replica, as a new job (a new url): the held call takes it.
        stack.publish("m-0", waking=wake)
        call = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        await asyncio.sleep(0.3)
        assert not call.done()
        again = await stack.engine("m-0")
        stack.publish("m-0", waking=wake)
        assert (await asyncio.wait_for(call, 5))[0] == 200 and len(again.received) == 1

    async with open_stack(CONFIG) as stack:  # not autoscaled: no wake in the table
        stack.dead("m-0")
        stack.publish("m-0")
        status, _, body = await asyncio.wait_for(stack.post("/v1/chat/completions", chat()), 5)
        assert status == 502, body
        assert_openai_error(body, "upstream_unreachable")


async def test_a_call_held_after_its_route_failed_waits_once_in_all() -> None:
    """A held call's wait counts from its first hold: when the routes it is given keep failing
    it is answered 503 within the wait it allowed, not once per route."""
    quick = CONFIG.model_copy(update={"hold_s": 1.5})
    async with open_stack(quick) as stack:
        wake = {"m": Waking(lead_s=0.5)}
        stack.dead("m-0")
        stack.publish("m-0", waking=wake)
        t0 = asyncio.get_running_loop().time()
        call = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        for i in range(1, 4):  # a new route each 0.4 s, each refusing connections
            await asyncio.sleep(0.4)
            stack.dead(f"m-{i}")
            stack.publish(f"m-{i}", waking=wake)
        status, headers, body = await asyncio.wait_for(call, 5)
        took = asyncio.get_running_loop().time() - t0
        assert status == 503 and "Retry-After" in headers, body
        assert_openai_error(body, "model_waking")
        assert took < 2.3, took  # 1.5 s in all (one wait per route would end after 2.7 s)


@pytest.mark.parametrize("hold_s", [0.0])
async def test_a_gateway_that_holds_nothing_answers_503_at_once(hold_s: float) -> None:
    async with open_stack(CONFIG.model_copy(update={"hold_s": hold_s})) as stack:
        asleep(stack, m=Waking(lead_s=1.0))
        status, headers, body = await stack.post("/v1/chat/completions", chat())
        assert status == 503 and headers["Retry-After"] == "2"  # the lead + the sync
        assert_openai_error(body, "model_waking")


@pytest.mark.adversarial
async def test_a_hostile_max_wait_header_is_a_400_and_holds_nothing() -> None:
    async with open_stack(CONFIG) as stack:
        asleep(stack, m=Waking(lead_s=1.0))
        for bad in ("soon", "-1", "nan", "inf", "1e99", "1" * 5000, "0x10", " ", "1;2"):
            status, _, body = await stack.post(
                "/v1/chat/completions", chat(), headers={"X-Xhpc-Max-Wait": bad}
            )
            assert status == 400, bad
            assert_openai_error(body, "invalid_max_wait")
        assert stack.router.demand()[1:] == ({}, {})  # a bad call is no demand; none held
        holds = stack.router  # nothing left held: a good call is held again
        call = asyncio.create_task(stack.post("/v1/chat/completions", chat()))
        await asyncio.sleep(0.2)
        assert not call.done()
        await stack.engine("m-0")
        stack.publish("m-0")
        assert (await asyncio.wait_for(call, 5))[0] == 200 and holds.routes("m")
