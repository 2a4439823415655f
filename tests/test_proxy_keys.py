"""API keys at the gateway: 401 without a valid key, 429 over a rate or a token quota, another
user's model is 404 and absent from /v1/models, usage is counted per key in batches, and the
replica's own secret (never the client's key) goes to the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.proxy_fakes import Stack, assert_openai_error, chat, open_stack
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.models import Route
from xhpc.proxy.tenants.keys import KeyBook, KeyRefused


def _grant(user: str, account: str | None = None, **limits: int) -> tuple[str, KeyGrant]:
    key_id, key, digest = new_key()
    return key, KeyGrant(key_id=key_id, digest=digest, user=user, account=account, **limits)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Stack, KeyBook, dict[str, str]]]:
    book = KeyBook()
    alice_key, alice = _grant("alice", "lab1")
    bob_key, bob = _grant("bob", "lab2", rpm=2)
    carol_key, carol = _grant("carol", "lab3", token_quota=5)
    book.update(
        Grants(
            keys=(alice, bob, carol),
            access=(
                ModelAccess(model="m", owner="alice", account="lab1"),
                ModelAccess(model="b", owner="bob", account="lab2"),
                ModelAccess(model="c", owner="carol", account="lab3"),
            ),
        )
    )
    async with open_stack() as s:
        await s.start_proxy(keys=book)
        for rid, model in (("a", "m"), ("bb", "b"), ("cc", "c")):
            await s.engine(rid, model)
        s.routes["a"] = s.routes["a"].model_copy(update={"secret": "replica-secret"})
        s.publish("a", "bb", "cc")
        yield s, book, {"alice": alice_key, "bob": bob_key, "carol": carol_key}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_no_key_or_a_wrong_key_is_401(gated: tuple[Stack, KeyBook, dict[str, str]]) -> None:
    s, _, keys = gated
    for headers in (
        None,
        _auth("sk-nope"),
        _auth(keys["alice"] + "x"),
        {"Authorization": keys["alice"]},
    ):
        status, _, body = await s.post("/v1/chat/completions", chat(), headers)
        assert status == 401
        assert_openai_error(body, "invalid_api_key")
    assert s.engines["a"].received == []


async def test_a_key_reaches_its_own_models_only(
    gated: tuple[Stack, KeyBook, dict[str, str]],
) -> None:
    s, _, keys = gated
    status, _, body = await s.post("/v1/chat/completions", chat("m"), _auth(keys["alice"]))
    assert status == 200
    # The engine got the replica's secret, never the client's key.
    assert s.engines["a"].authorization == ["Bearer replica-secret"]
    status, _, body = await s.post("/v1/chat/completions", chat("b"), _auth(keys["alice"]))
    assert status == 404
    assert_openai_error(body, "model_not_found")
    assert s.engines["bb"].received == []
    async with s.client.get(s.url + "/v1/models", headers=_auth(keys["alice"])) as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
    async with s.client.get(s.url + "/v1/models/b", headers=_auth(keys["alice"])) as resp:
        assert resp.status == 404
    async with s.client.get(s.url + "/v1/models") as resp:
        assert resp.status == 401


async def test_over_the_rate_is_429_with_retry_after(
    gated: tuple[Stack, KeyBook, dict[str, str]],
) -> None:
    s, _, keys = gated
    for _ in range(2):
        status, _, _ = await s.post("/v1/chat/completions", chat("b"), _auth(keys["bob"]))
        assert status == 200
    status, headers, body = await s.post("/v1/chat/completions", chat("b"), _auth(keys["bob"]))
    assert status == 429
    assert_openai_error(body, "rate_limit_exceeded")
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert len(s.engines["bb"].received) == 2


async def test_tokens_are_counted_per_key_and_a_quota_stops_requests(
    gated: tuple[Stack, KeyBook, dict[str, str]],
) -> None:
    s, book, keys = gated
    status, _, body = await s.post("/v1/chat/completions", chat("c"), _auth(keys["carol"]))
    assert status == 200
    used = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert used >= 5  # the fake engine's usage is over carol's quota of 5 tokens
    status, _, body = await s.post("/v1/chat/completions", chat("c"), _auth(keys["carol"]))
    assert status == 429
    assert_openai_error(body, "insufficient_quota")
    report = book.take_report("p1")
    ((key_id, per_model),) = report.usage.items()
    assert book.grants[key_id].user == "carol"
    assert per_model["c"].requests == 1
    assert per_model["c"].prompt_tokens + per_model["c"].completion_tokens == used
    # Sent to the broker: its total now includes them, and the proxy's own count resets.
    grant = book.grants[key_id].model_copy(update={"tokens_used": used})
    book.sent(report, Grants(keys=(grant,), access=tuple(book.access.values())))
    assert book.unsent_tokens[key_id] == 0
    assert book.take_report("p1").usage == {}


def test_an_unsent_report_is_counted_again() -> None:
    book = KeyBook()
    _, grant = _grant("dan")
    book.update(Grants(keys=(grant,)))
    book.record(grant, "m", (3, 4))
    report = book.take_report("p1")
    book.unsent(report)
    again = book.take_report("p1").usage[grant.key_id]["m"]
    assert (again.requests, again.prompt_tokens, again.completion_tokens) == (1, 3, 4)


def test_routes_carry_the_secret_but_never_show_it() -> None:
    route = Route(model="m", replica_id="r", url="http://x", served_model="m", secret="s3cret")
    assert "s3cret" not in repr(route)


def test_a_revoked_key_is_refused_even_after_it_was_verified() -> None:
    book = KeyBook()
    key, grant = _grant("erin")
    book.update(Grants(keys=(grant,)))
    assert book.admit(f"Bearer {key}") == grant
    assert book.admit(f"Bearer {key}") == grant  # from the verified cache
    book.update(Grants(keys=()))  # revoked
    with pytest.raises(KeyRefused):
        book.admit(f"Bearer {key}")
    # A key whose digest changed (re-issued id) is verified again, not taken from the cache.
    _, other = _grant("erin")
    book.update(Grants(keys=(grant.model_copy(update={"digest": other.digest}),)))
    with pytest.raises(KeyRefused):
        book.admit(f"Bearer {key}")
