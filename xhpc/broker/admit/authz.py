"""Who may call each endpoint of the control API (pure): one table, checked before any handler.

The caller is the Unix user at the other end of the control socket (``SO_PEERCRED``, read by
``xhpc.broker.api.peer_caller``). Each endpoint names one of these:

- ``anyone``: every local user who reaches the socket (a lab broker's socket is 0666).
- ``owner``: anyone may call it; the service refuses a target owned by another user unless the
  caller is an admin (``xhpc.access.check_owner``).
- ``self``: anyone may call it; the answer is narrowed to the caller's own rows (admins: all).
- ``proxy``: the proxy's identity only: ``broker.proxy_users``, the broker's own user and root.
  These calls hand out every replica's engine secret and every key's digest.
- ``admin``: ``broker.admins``, the broker's own user and root.
- ``operator``: both of the above: admins, proxy users, the broker's own user and root. The
  metrics name every deployment, replica, job and node: for admins, and for the gateway, which
  adds them to its own ``/metrics`` (itself for admin keys only, or on its private listener).

A member's broker (``broker.socket_group`` without ``shared_socket``, decision 0014) shares
its socket with a group only so that the lab gateway's user reaches it; every member of that
group reaches it too. Such a broker is ``sole``: before its table, a caller must be the broker's
own user, root, an admin (``broker.admins``) or a proxy user (``broker.proxy_users``); anyone
else is refused every endpoint but liveness (``GET /v1/health``), ``POST /v1/serve`` included
(which would submit a job as the broker's user).

On the endpoints marked ``acts`` (the Batch API: the gateway calls them for a key's user) a
call names the user it is made for (``xhpc.access.ACTING_USER_HEADER``, and the key:
``ACTING_KEY_HEADER``). The proxy's identity must name one (400 without) and the broker then
acts as exactly that user, never as an admin, whatever the proxy's own rights; anyone else may
name only itself. Every other endpoint refuses a call that names an acting user: a gateway's
call that reached one (a path gone astray) is refused, not run with the gateway's rights.

An endpoint missing from the table is refused (deny by default); a unit test checks that every
route the control app registers has its rule. A caller of None (the transport is not a Unix
socket: in-process tests) is trusted, as before. docs/security.md prints the table
(``markdown_table``); a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from xhpc.access import Caller


class Allow(StrEnum):
    ANYONE = "anyone"
    OWNER = "owner"
    SELF = "self"
    PROXY = "proxy"
    ADMIN = "admin"
    OPERATOR = "operator"


@dataclass(frozen=True)
class Rule:
    method: str  # GET or POST; HEAD follows GET's rule
    path: str  # aiohttp's pattern, e.g. /v1/deployments/{name}
    allow: Allow
    protects: str  # what the rule guards, for docs/security.md
    acts: bool = False  # called for a named user (the gateway's key holders): see above


_ANY, _OWN, _SELF, _PROXY, _ADMIN = Allow.ANYONE, Allow.OWNER, Allow.SELF, Allow.PROXY, Allow.ADMIN
_OPS = Allow.OPERATOR

RULES: tuple[Rule, ...] = (
    Rule("GET", "/v1/health", _ANY, "nothing: liveness"),
    Rule("POST", "/v1/serve", _ANY, "the caller becomes the deployment's owner"),
    Rule("GET", "/v1/replicas", _ANY, "states, nodes, ports; no secrets"),
    Rule("GET", "/v1/deployments", _ANY, "the lab's deployments; no secrets"),
    Rule("GET", "/v1/deployments/{name}", _ANY, "one deployment; no secrets"),
    Rule("GET", "/v1/nodes", _ANY, "the cluster snapshot placement uses"),
    Rule("GET", "/v1/pilots", _ANY, "pilot jobs and their replicas"),
    Rule("GET", "/v1/overview", _ANY, "nodes, replicas, in-flight counts, events; no secrets"),
    Rule("POST", "/v1/stop", _OWN, "another member's deployments and replicas"),
    Rule("POST", "/v1/scale", _OWN, "another member's deployments"),
    Rule("POST", "/v1/deployments/{name}/scaling", _OWN, "another member's scaling policies"),
    Rule("GET", "/v1/replicas/{replica_id}/logs", _OWN, "job and engine logs (may hold prompts)"),
    Rule("GET", "/v1/usage", _SELF, "other members' usage"),
    Rule("POST", "/v1/batch-inputs", _ANY, "the caller's own inputs; streamed, capped", acts=True),
    Rule("POST", "/v1/batches", _ANY, "the caller becomes the batch's owner", acts=True),
    Rule("GET", "/v1/batches", _SELF, "other members' batches", acts=True),
    Rule(
        "GET",
        "/v1/batches/{batch_id}",
        _OWN,
        "another member's batch and its counts (404 to them)",
        acts=True,
    ),
    Rule(
        "GET",
        "/v1/batches/{batch_id}/output",
        _OWN,
        "another member's results (404 to them)",
        acts=True,
    ),
    Rule(
        "POST",
        "/v1/batches/{batch_id}/cancel",
        _OWN,
        "another member's batches (404 to them)",
        acts=True,
    ),
    Rule("GET", "/v1/routes", _PROXY, "engine addresses and secrets: a bypass of keys and quotas"),
    Rule("POST", "/v1/proxy/sync", _PROXY, "engine secrets; the drain bookkeeping of proxies"),
    Rule("POST", "/v1/proxy/grants", _PROXY, "key digests, admin flags; the usage quotas count"),
    Rule("POST", "/v1/keys", _ADMIN, "minting keys (admin keys use every model)"),
    Rule("GET", "/v1/keys", _ADMIN, "who holds which key and its limits"),
    Rule("POST", "/v1/keys/{key_id}/revoke", _ADMIN, "other members' keys"),
    Rule("GET", "/v1/orphans", _ADMIN, "the broker's view of stray jobs"),
    Rule("POST", "/v1/orphans/fix", _ADMIN, "cancelling or adopting jobs, marking replicas lost"),
    Rule("POST", "/v1/adapters", _ANY, "the caller's own files on their own deployment"),
    Rule("GET", "/v1/adapters", _ANY, "the lab's adapters, their bases and owners; no contents"),
    Rule("POST", "/v1/adapters/{name}/rm", _ANY, "another member's adapters (checked as owner)"),
    Rule("GET", "/v1/cache", _ANY, "which models are cached where, sizes, users; no contents"),
    Rule("POST", "/v1/cache/rm", _ADMIN, "node-local copies other members' replicas load"),
    Rule("POST", "/v1/cache/prune", _ADMIN, "node-local copies other members' replicas load"),
    Rule(
        "POST", "/v1/cache/pull", _ADMIN, "the site's shared model store, which every replica loads"
    ),
    Rule("GET", "/v1/cache/pulls/{pull_id}", _ADMIN, "a pull's source path, job and outcome"),
    Rule("GET", "/v1/metrics", _OPS, "every deployment, replica, job and node; engines' series"),
)

_BY_ENDPOINT: dict[tuple[str, str], Rule] = {(r.method, r.path): r for r in RULES}

_WHO = {
    Allow.PROXY: "the proxy's identity (broker.proxy_users, the broker's user, root)",
    Allow.ADMIN: "admins (broker.admins, the broker's user, root)",
    Allow.OPERATOR: "admins and the proxy's identity (broker.admins, broker.proxy_users, the "
    "broker's user, root)",
}


def rule_for(method: str, path: str | None) -> Rule | None:
    """The rule of an endpoint by its method and route pattern; None: no rule (refused)."""
    if path is None:
        return None
    return _BY_ENDPOINT.get(("GET" if method == "HEAD" else method, path))


# What a sole broker's socket answers to whoever reaches it.
OPEN_TO_ALL = frozenset({("GET", "/v1/health")})


def trusted(caller: Caller, owner_uid: int) -> bool:
    """The broker's own user (``owner_uid``), root, an admin or a proxy user."""
    return caller.uid in (0, owner_uid) or caller.admin or caller.proxy


def permits(rule: Rule | None, caller: Caller | None, sole_uid: int | None = None) -> bool:
    """Whether ``caller`` may call the endpoint of ``rule``; ``sole_uid``: the broker is a
    member's (``broker.socket_group``), run as this uid, and serves trusted callers only."""
    if caller is None:  # not a Unix socket: the broker's own process (in-process tests)
        return True
    if rule is None:
        return False
    if sole_uid is not None and not trusted(caller, sole_uid):
        return (rule.method, rule.path) in OPEN_TO_ALL
    if rule.allow is Allow.PROXY:
        return caller.proxy
    if rule.allow is Allow.ADMIN:
        return caller.admin
    if rule.allow is Allow.OPERATOR:
        return caller.admin or caller.proxy
    return True  # anyone, owner (checked by the service) and self (narrowed by the handler)


def check(
    method: str, path: str | None, shown: str, caller: Caller | None, sole_uid: int | None = None
) -> None:
    """PermissionError unless ``caller`` may call ``method path``; ``shown`` names the path the
    caller asked for in the message; ``sole_uid``: as ``permits``."""
    rule = rule_for(method, path)
    if caller is None or permits(rule, caller, sole_uid):
        return
    if rule is None:
        raise PermissionError(f"{method} {shown} is not an endpoint anyone may call")
    if sole_uid is not None and not trusted(caller, sole_uid):
        raise PermissionError(
            f"this broker serves its own user, admins and the lab gateway only "
            f"(broker.socket_group); you are {caller.user}"
        )
    raise PermissionError(
        f"{method} {rule.path} is for {_WHO[rule.allow]} only; you are {caller.user}"
    )


def markdown_table() -> str:
    """The endpoint x caller table as docs/security.md shows it."""
    allowed = {
        Allow.ANYONE: ("yes", "yes", "yes", "yes"),
        Allow.OWNER: ("own targets", "all", "own targets", "all"),
        Allow.SELF: ("own rows", "all", "own rows", "all"),
        Allow.PROXY: ("no", "no", "yes", "yes"),
        Allow.ADMIN: ("no", "yes", "no", "yes"),
        Allow.OPERATOR: ("no", "yes", "yes", "yes"),
    }
    lines = [
        "| endpoint | rule | member | admin | proxy user | broker's user, root | protects |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in RULES:
        cells = " | ".join(allowed[r.allow])
        lines.append(f"| `{r.method} {r.path}` | {r.allow.value} | {cells} | {r.protects} |")
    return "\n".join(lines)
