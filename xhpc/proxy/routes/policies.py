"""Routing policies: which of a model's replicas takes a request (pure logic, no I/O).

A policy is a small object with one method, ``pick(info, candidates, load) -> Route``:

- ``info`` says what the policy may know about the request (its model and, for affinity, a key);
- ``candidates`` are the replicas allowed now, non-empty, in ``replica_id`` order (the router has
  already removed replicas whose circuit breaker is open and those a retry must avoid);
- ``load`` gives each replica's in-flight request count.

Policies: ``least-outstanding`` (the default), ``round-robin``, and ``affinity`` (consistent
hashing with bounded load over a session id, a user id or the prompt's prefix). A
prefill/decode model has one policy per role, each picking among that role's instances only
(``Router.pick(..., role=...)``, ``xhpc.proxy.pd``); the policies themselves do not change.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from xhpc.models import Route
from xhpc.settings import RoutingPolicyName

VNODES = 100  # points per replica on the hash ring: ~±10 % spread over keys
RING_CACHE = 64  # candidate sets whose rings are kept


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about a request."""

    model: str
    affinity_key: str | None = None  # "s:<session>", "u:<user>" or "p:<prompt prefix>"


class Load(Protocol):
    def outstanding(self, replica_id: str) -> int: ...


class Policy(Protocol):
    name: ClassVar[RoutingPolicyName]
    uses_key: ClassVar[bool]  # whether the caller should compute ``info.affinity_key``

    def pick(self, info: RequestInfo, candidates: Sequence[Route], load: Load) -> Route: ...


class LeastOutstanding:
    """The replica with the fewest in-flight requests; ties rotate in ``replica_id`` order."""

    name: ClassVar[RoutingPolicyName] = "least-outstanding"
    uses_key: ClassVar[bool] = False

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, info: RequestInfo, candidates: Sequence[Route], load: Load) -> Route:
        if len(candidates) == 1:
            return candidates[0]
        counts = [load.outstanding(r.replica_id) for r in candidates]
        least = min(counts)
        tied = [r for r, n in zip(candidates, counts, strict=True) if n == least]
        turn = self._turn
        self._turn = turn + 1
        return tied[turn % len(tied)]


class RoundRobin:
    """Each replica in turn, whatever its load."""

    name: ClassVar[RoutingPolicyName] = "round-robin"
    uses_key: ClassVar[bool] = False

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, info: RequestInfo, candidates: Sequence[Route], load: Load) -> Route:
        turn = self._turn
        self._turn = turn + 1
        return candidates[turn % len(candidates)]


def _hash64(text: str) -> int:
    """A stable 64-bit hash (the same in every proxy process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    """A consistent-hash ring of replica ids, ``VNODES`` points each."""

    __slots__ = ("owners", "points")

    def __init__(self, replica_ids: Sequence[str]) -> None:
        pairs = sorted((_hash64(f"{rid}#{i}"), rid) for rid in replica_ids for i in range(VNODES))
        self.points = [p for p, _ in pairs]
        self.owners = [rid for _, rid in pairs]

    def walk(self, key_hash: int) -> Iterator[str]:
        """Replica ids in ring order from ``key_hash``, each once (lazily: the first usually
        suffices)."""
        owners = self.owners
        n = len(owners)
        start = bisect.bisect_left(self.points, key_hash)
        seen: set[str] = set()
        for i in range(start, start + n):
            rid = owners[i % n]
            if rid not in seen:
                seen.add(rid)
                yield rid


class Affinity:
    """Consistent hashing with bounded load (Mirrokni, Thorup & Zadimoghaddam, 2018).

    A request with a key goes to the first replica clockwise from the key's hash whose in-flight
    count is below ``ceil((1 + load_factor) * (in-flight total + 1) / replicas)``; requests
    sharing a key share a replica (and its prefix cache) until it is that much busier than the
    mean. Removing a replica moves only the keys it held. Requests without a key are routed by
    least outstanding.
    """

    name: ClassVar[RoutingPolicyName] = "affinity"
    uses_key: ClassVar[bool] = True

    def __init__(self, load_factor: float = 0.25) -> None:
        self.load_factor = load_factor
        self._rings: dict[tuple[str, ...], _Ring] = {}
        self._fallback = LeastOutstanding()

    def _ring(self, candidates: Sequence[Route]) -> _Ring:
        ids = tuple(r.replica_id for r in candidates)
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= RING_CACHE:
                self._rings.clear()
            ring = self._rings[ids] = _Ring(ids)
        return ring

    def capacity(self, total_in_flight: int, replicas: int) -> int:
        """The in-flight count at which a replica is skipped for the next request."""
        return math.ceil((1 + self.load_factor) * (total_in_flight + 1) / replicas)

    def pick(self, info: RequestInfo, candidates: Sequence[Route], load: Load) -> Route:
        if info.affinity_key is None:
            return self._fallback.pick(info, candidates, load)
        if len(candidates) == 1:
            return candidates[0]
        by_id = {r.replica_id: r for r in candidates}
        counts = {rid: load.outstanding(rid) for rid in by_id}
        cap = self.capacity(sum(counts.values()), len(counts))
        for rid in self._ring(candidates).walk(_hash64(info.affinity_key)):
            if counts[rid] < cap:
                return by_id[rid]
        raise AssertionError("unreachable: capacity x replicas > in-flight total")


def make_policy(name: RoutingPolicyName, *, load_factor: float = 0.25) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "affinity":
        return Affinity(load_factor)
    return LeastOutstanding()


def _text(content: Any) -> str:
    """The text of a message's content (a string, or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def _prompt_prefix(body: Mapping[str, Any], limit: int) -> str:
    """The first ``limit`` characters of the prompt (chat messages, a prompt, or an input)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        out: list[str] = []
        size = 0
        for msg in messages:
            if size >= limit or not isinstance(msg, dict):
                break
            piece = f"{msg.get('role', '')}\x00{_text(msg.get('content'))}\x00"
            out.append(piece)
            size += len(piece)
        return "".join(out)[:limit]
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str | list) else prompt
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list):  # token ids
        return ",".join(str(t) for t in prompt[:limit])
    return ""


def affinity_key(body: Mapping[str, Any], session_id: str | None, prefix_chars: int) -> str | None:
    """The key that keeps related requests on one replica: the ``X-Session-Id`` header, else
    the ``user`` field, else the prompt's first ``prefix_chars`` characters; None if empty."""
    if session_id:
        return "s:" + session_id
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user
    prefix = _prompt_prefix(body, prefix_chars)
    return "p:" + prefix if prefix else None
