"""API keys at the gateway: who is calling, may they use this model, are they within limits.

The broker owns keys (only digests) and usage; the proxy holds the live grants in memory,
refreshed with the routing table, and counts requests and tokens locally. Counts go to the
broker in batches (``POST /v1/proxy/grants``) — never a write per request on the hot path.
Rate limits are token buckets per key (requests per minute); a token quota is checked against
the broker's total plus what this proxy has counted since plus the output budgets reserved by
the key's requests in flight, and a key's concurrent requests may be capped
(``xhpc.proxy.tenants.quota``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pydantic
from aiohttp import web

from xhpc.access import (
    Grants,
    KeyGrant,
    ModelAccess,
    UsageCount,
    UsageReport,
    digest_matches,
    may_use,
    split_key,
)
from xhpc.clock import monotonic
from xhpc.errors import BrokerError, BrokerUnavailableError, error_body
from xhpc.proxy import broker_call
from xhpc.proxy.lab import lab_grants
from xhpc.proxy.relay.sse import Usage
from xhpc.proxy.source import BrokerRouteSource
from xhpc.proxy.tenants.quota import Hold, Holds
from xhpc.proxy.tenants.rates import SharedBuckets
from xhpc.wire import read_json

logger = logging.getLogger(__name__)

GRANTS_PATH = "/v1/proxy/grants"
GRANTS_TIMEOUT_S = 5.0
VERIFIED_MAX = 100_000


class KeyRefused(Exception):
    """The request is refused: an OpenAI-shaped error with this status, type and code."""

    def __init__(
        self, status: int, message: str, code: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        kind = {
            401: "authentication_error",
            403: "permission_error",
            429: "rate_limit_error",
        }.get(self.status, "error")
        body = error_body(self.message, type_=kind, code=self.code)
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.json_response(body, status=self.status, headers=headers)


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class KeyBook:
    """The live grants, the per-key buckets and the counts not yet sent to the broker."""

    enabled: bool = True
    grants: dict[str, KeyGrant] = field(default_factory=dict)
    access: dict[str, ModelAccess] = field(default_factory=dict)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    shared: SharedBuckets | None = None  # the buckets of a gateway with several workers
    pending: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    )
    unsent_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Keys already verified against the current grants: presented key -> key id. Spares the
    # digest on every request; cleared whenever the grants change (a revoked key drops out).
    verified: dict[str, str] = field(default_factory=dict)
    holds: Holds = field(default_factory=Holds)  # slots and reservations of requests in flight

    def update(self, grants: Grants) -> None:
        new = {g.key_id: g for g in grants.keys}
        if {k: g.digest for k, g in new.items()} != {k: g.digest for k, g in self.grants.items()}:
            self.verified.clear()
        self.grants = new
        self.access = {a.model: a for a in grants.access}

    def _verify(self, presented: str) -> KeyGrant | None:
        key_id = self.verified.get(presented)
        if key_id is not None:
            return self.grants.get(key_id)
        parts = split_key(presented)
        grant = self.grants.get(parts[0]) if parts else None
        if parts is None or grant is None or not digest_matches(parts[1], grant.digest):
            return None
        if len(self.verified) < VERIFIED_MAX:
            self.verified[presented] = grant.key_id
        return grant

    def admit(self, authorization: str | None, *, charge: bool = True) -> KeyGrant | None:
        """The caller's grant; KeyRefused when the key is missing, wrong or over a limit.
        None when keys are not required (``proxy.auth = "none"``). ``charge=False``: a read
        (listing models) that spends none of the key's rate."""
        grant = self.identify(authorization)
        if grant is None:
            return None
        if grant.rpm is not None and charge:
            self._take(grant.key_id, grant.rpm)
        self._check_quota(grant)
        return grant

    def identify(self, authorization: str | None) -> KeyGrant | None:
        """The caller's grant, limits aside; KeyRefused (401) when the key is missing or wrong.
        None when keys are not required."""
        if not self.enabled:
            return None
        presented = authorization[7:].strip() if authorization else ""
        if authorization and not authorization.startswith("Bearer "):
            presented = ""
        grant = self._verify(presented)
        if grant is None:
            raise KeyRefused(401, "invalid or missing API key", "invalid_api_key")
        return grant

    def _check_quota(self, grant: KeyGrant) -> None:
        """KeyRefused (429) unless the key has tokens left, its requests in flight's
        reservations counted as spent."""
        quota = grant.token_quota
        if quota is None:
            return
        used = grant.tokens_used + self.unsent_tokens.get(grant.key_id, 0)
        reserved = self.holds.reserved_by_all(grant.key_id)
        if used + reserved >= quota:
            held = f", {reserved} more reserved by requests in flight" if reserved else ""
            raise KeyRefused(
                429,
                f"token quota of {quota} used up ({used} tokens{held})",
                "insufficient_quota",
            )

    def enter(self, grant: KeyGrant | None) -> Hold | None:
        """The request's hold on its key, with a concurrency slot if the key has a cap;
        KeyRefused (429, Retry-After) when it has ``max_concurrent`` requests in flight
        here. Give it back with ``finish``. None for a key with neither a cap nor a quota."""
        if grant is None:
            return None
        cap = grant.max_concurrent
        if cap is None and grant.token_quota is None:
            return None  # the usual key: nothing to hold
        hold = Hold(grant.key_id)
        if cap is not None and not self.holds.enter(hold, cap):
            raise KeyRefused(
                429,
                f"limit of {cap} concurrent requests reached",
                "concurrency_limit_exceeded",
                retry_after_s=1.0,
            )
        return hold

    def reserve(self, grant: KeyGrant | None, hold: Hold | None, tokens: int) -> None:
        """Reserve the request's output budget against its key's quota (if it has one);
        KeyRefused (429) when nothing is left. Check and reservation are one step: no other
        request of this worker is admitted in between."""
        if grant is None or hold is None or grant.token_quota is None:
            return
        self._check_quota(grant)
        self.holds.reserve(hold, tokens)

    def finish(
        self,
        grant: KeyGrant | None,
        hold: Hold | None,
        model: str,
        usage: Usage | None,
        answered: bool,
    ) -> None:
        """The request ended: its hold given back, its usage counted (for a known ``model``).
        An ``answered`` request that reserved tokens but whose usage never came is charged
        its reservation as completion tokens."""
        if hold is not None:
            if usage is None and answered and hold.tokens:
                usage = Usage(0, hold.tokens)
            self.holds.release(hold)
        if model:
            self.record(grant, model, usage)

    def _take(self, key_id: str, rpm: int) -> None:
        now = monotonic()
        rate = rpm / 60.0
        if self.shared is not None:  # one bucket for all the gateway's workers
            tokens = self.shared.take(key_id, rpm, now)
        else:
            b = self.buckets.get(key_id) or _Bucket(tokens=float(rpm), at=now)
            tokens = b.tokens = min(float(rpm), b.tokens + (now - b.at) * rate)
            b.at = now
            self.buckets[key_id] = b
            if tokens >= 1.0:
                b.tokens -= 1.0
        if tokens < 1.0:
            raise KeyRefused(
                429,
                f"rate limit of {rpm} requests per minute reached",
                "rate_limit_exceeded",
                retry_after_s=(1.0 - tokens) / rate,
            )

    def may_use(self, grant: KeyGrant | None, model: str) -> bool:
        return grant is None or may_use(grant, self.access.get(model))

    def visible(self, grant: KeyGrant | None, models: Iterable[str]) -> list[str]:
        return [m for m in models if self.may_use(grant, m)]

    def record(self, grant: KeyGrant | None, model: str, usage: Sequence[int] | None) -> None:
        """Count one request and its tokens (``usage``: prompt, completion) for its key."""
        if grant is None:
            return
        prompt, completion = (usage[0], usage[1]) if usage else (0, 0)
        counts = self.pending[grant.key_id][model]
        counts[0] += 1
        counts[1] += prompt
        counts[2] += completion
        self.unsent_tokens[grant.key_id] += prompt + completion

    def take_report(self, proxy_id: str) -> UsageReport:
        usage = {
            key: {
                m: UsageCount(requests=c[0], prompt_tokens=c[1], completion_tokens=c[2])
                for m, c in models.items()
            }
            for key, models in self.pending.items()
        }
        self.pending.clear()
        return UsageReport(proxy_id=proxy_id, usage=usage)

    def sent(self, report: UsageReport, grants: Grants) -> None:
        """The broker has the report: its totals now include what this proxy had counted."""
        for key, models in report.usage.items():
            sent = sum(c.prompt_tokens + c.completion_tokens for c in models.values())
            self.unsent_tokens[key] = max(0, self.unsent_tokens[key] - sent)
        self.update(grants)

    def unsent(self, report: UsageReport) -> None:
        """The broker did not take the report: count it again next time."""
        for key, models in report.usage.items():
            for m, c in models.items():
                counts = self.pending[key][m]
                counts[0] += c.requests
                counts[1] += c.prompt_tokens
                counts[2] += c.completion_tokens


KEYBOOK_KEY = web.AppKey("xhpc_keybook", KeyBook)


class GrantSource:
    """Sends batched usage and fetches the grants every ``interval_s`` for an app's lifetime.

    A lab gateway (``routes`` reads several brokers) asks its member brokers too, for the
    accounts their models are shared with; keys and usage stay with the first broker
    (``xhpc.proxy.lab.lab_grants``). A member's grants count only when the uid that sent them
    (the peer credentials of their connection) sent its routes too. Each answer is read with
    ``xhpc.proxy.broker_call``, at most ``max_answer_bytes`` of it."""

    def __init__(
        self,
        socket_path: Path,
        book: KeyBook,
        interval_s: float,
        routes: BrokerRouteSource | None = None,
        *,
        max_answer_bytes: int = broker_call.MAX_ANSWER,
    ) -> None:
        self.socket_path = socket_path
        self.book = book
        self.interval_s = interval_s
        self.routes = routes
        self.max_answer_bytes = max_answer_bytes
        self.proxy_id = f"{socket.gethostname()}:{os.getpid()}"
        self.syncs = 0  # successful exchanges with the broker so far

    async def sync_once(self) -> bool:
        report = self.book.take_report(self.proxy_id)
        try:
            grants, _ = await self._grants(self.socket_path, report)
        except _FAILURES as err:
            self.book.unsent(report)
            logger.debug("grants sync failed: %s", err)
            return False
        routes = self.routes
        if routes is not None and len(routes.links) > 1:
            ask = UsageReport(proxy_id=self.proxy_id)  # usage goes to the first only
            for link in routes.links[1:]:
                # A member broker that does not answer keeps the accounts it told last; its
                # routes say whether it is up.
                try:
                    member, uid = await self._grants(link.socket_path, ask)
                except _FAILURES as err:
                    logger.debug("grants of the broker at %s: %s", link.socket_path, err)
                    continue
                if link.uid not in (uid, None) and link.access_uid != uid:  # once a change
                    logger.warning(
                        "the broker at %s sent its routes as uid %s and its grants as uid %s: "
                        "its grants are ignored",
                        link.socket_path,
                        link.uid,
                        uid,
                    )
                link.access, link.access_uid = member.access, uid
            grants = lab_grants(grants, routes.links, routes.lab.broker_of)
        self.book.sent(report, grants)
        self.syncs += 1
        return True

    async def _grants(self, path: Path, report: UsageReport) -> tuple[Grants, int | None]:
        """A broker's grants, and the uid of the process that sent them."""
        answer = await broker_call.call(
            path,
            "POST",
            GRANTS_PATH,
            report.model_dump_json().encode(),
            timeout_s=GRANTS_TIMEOUT_S,
            max_bytes=self.max_answer_bytes,
        )
        if answer.status != 200:
            raise BrokerError(
                f"broker answered {answer.status} to POST {GRANTS_PATH}", status=answer.status
            )
        return read_json(Grants, answer.body), answer.uid

    def install(self, app: web.Application) -> None:
        app.cleanup_ctx.append(self._lifespan)

    async def _lifespan(self, app: web.Application) -> AsyncIterator[None]:
        await self.sync_once()
        task = asyncio.create_task(self._loop(), name="xhpc-proxy-grants")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.sync_once()  # the last counts are not lost

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sync_once()


_FAILURES = (BrokerError, BrokerUnavailableError, pydantic.ValidationError)
