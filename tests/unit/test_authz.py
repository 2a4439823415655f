"""The control API's access table: every registered endpoint has a rule, an endpoint without one
is refused, each kind of caller gets what its rule says, and docs/security.md prints the table."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from xhpc.access import Caller, KeyView, UsageReport
from xhpc.broker import api
from xhpc.broker.admit import authz
from xhpc.broker.admit.authz import Allow
from xhpc.broker.api import control_app
from xhpc.broker.service import BrokerService
from xhpc.errors import ValidationError as XhpcValidationError
from xhpc.models import NodeInfo, PartitionInfo
from xhpc.settings import XhpcConfig
from xhpc.store import Store

pytestmark = pytest.mark.security

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"

MEMBER = Caller(user="bob", uid=1001)
ADMIN = Caller(user="ann", uid=1002, admin=True)
PROXY = Caller(user="gw", uid=1003, proxy=True)
ROOT = Caller(user="root", uid=0, admin=True, proxy=True)
NOW = datetime(2026, 1, 1, tzinfo=UTC)


class NoSlurm:
    """Enough of the Slurm client for a service that is never asked to submit."""

    async def nodes(self) -> list[NodeInfo]:
        return []

    async def jobs(self, job_ids: object = ()) -> list[object]:
        return []

    async def submit(self, script: Path) -> str:
        raise AssertionError("not expected")

    async def cancel(self, job_ids: object, signal: str | None = None) -> None:
        return None

    async def partitions(self) -> list[PartitionInfo]:
        return []

    async def accounting_storage_type(self) -> str:
        return "accounting_storage/none"


def _app(tmp_path: Path) -> web.Application:
    config = XhpcConfig(state_dir=tmp_path / "state")
    store = Store(tmp_path / "state" / "x.db")
    return control_app(BrokerService(config, store, NoSlurm()))  # type: ignore[arg-type]


def _endpoints(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        assert route.resource is not None
        method = "GET" if route.method == "HEAD" else route.method
        out.add((method, route.resource.canonical))
    return out


def test_every_control_endpoint_has_exactly_one_rule(tmp_path: Path) -> None:
    registered = _endpoints(_app(tmp_path))
    ruled = [(r.method, r.path) for r in authz.RULES]
    assert len(ruled) == len(set(ruled)), "an endpoint has two rules"
    missing = registered - set(ruled)
    assert not missing, f"endpoints with no access rule in xhpc/broker/admit/authz.py: {missing}"
    stale = set(ruled) - registered
    assert not stale, f"rules for endpoints the control app does not register: {stale}"


def test_each_kind_of_caller_gets_what_its_rule_says() -> None:
    expected = {
        Allow.ANYONE: {"member", "admin", "proxy", "root"},
        Allow.OWNER: {"member", "admin", "proxy", "root"},  # the service checks the target
        Allow.SELF: {"member", "admin", "proxy", "root"},  # the handler narrows the answer
        Allow.PROXY: {"proxy", "root"},
        Allow.ADMIN: {"admin", "root"},
        Allow.OPERATOR: {"admin", "proxy", "root"},
    }
    callers = {"member": MEMBER, "admin": ADMIN, "proxy": PROXY, "root": ROOT}
    for rule in authz.RULES:
        allowed = {name for name, c in callers.items() if authz.permits(rule, c)}
        assert allowed == expected[rule.allow], rule
        assert authz.permits(rule, None)  # not a Unix socket: in-process, trusted


def test_engine_secrets_and_usage_reports_are_for_the_proxy_only() -> None:
    for path in ("/v1/routes",):
        assert authz.rule_for("GET", path).allow is Allow.PROXY  # type: ignore[union-attr]
        assert authz.rule_for("HEAD", path).allow is Allow.PROXY  # type: ignore[union-attr]
    for path in ("/v1/proxy/sync", "/v1/proxy/grants"):
        assert authz.rule_for("POST", path).allow is Allow.PROXY  # type: ignore[union-attr]
    with pytest.raises(PermissionError, match=r"is for the proxy's identity .* you are ann"):
        authz.check("GET", "/v1/routes", "/v1/routes", ADMIN)


def test_an_endpoint_without_a_rule_is_refused() -> None:
    assert authz.rule_for("GET", "/v1/secret-things") is None
    assert authz.rule_for("POST", "/v1/routes") is None  # the rule is per method
    assert not authz.permits(None, ROOT)
    with pytest.raises(PermissionError, match="GET /v1/nope is not an endpoint"):
        authz.check("GET", None, "/v1/nope", ROOT)
    authz.check("GET", None, "/v1/nope", None)  # in-process: today's 404 stands


async def test_the_middleware_refuses_a_route_added_without_a_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(tmp_path)

    async def secret(_: web.Request) -> web.Response:
        return web.json_response({"secret": "s3cr3t"})

    app.router.add_get("/v1/secret", secret)
    monkeypatch.setattr(api, "peer_caller", lambda *_: ROOT)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/v1/secret")
        body = await resp.json()
        assert resp.status == 403 and body["error"]["code"] == "forbidden"
        assert "s3cr3t" not in await resp.text()
        assert (await client.get("/v1/health")).status == 200
    monkeypatch.setattr(api, "peer_caller", lambda *_: MEMBER)
    async with TestClient(TestServer(_app(tmp_path))) as client:
        resp = await client.get("/v1/keys")
        assert resp.status == 403
        assert (await resp.json())["error"] == {
            "code": "forbidden",
            "message": "GET /v1/keys is for admins (broker.admins, the broker's user, root) "
            "only; you are bob",
        }


def test_usage_reports_are_never_negative() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        UsageReport.model_validate_json(
            '{"proxy_id": "p", "usage": {"k": {"m": {"prompt_tokens": -1000}}}}'
        )
    with pytest.raises(ValueError, match="less than or equal to"):
        UsageReport.model_validate_json(
            '{"proxy_id": "p", "usage": {"k": {"m": {"requests": 1000000000000000000000}}}}'
        )


def test_docs_security_prints_the_table() -> None:
    text = DOC.read_text()
    start, end = "<!-- authz-table:start -->\n", "\n<!-- authz-table:end -->"
    assert start in text and end in text, "docs/security.md lost its table markers"
    shown = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert shown == authz.markdown_table(), (
        "docs/security.md's table differs from xhpc/broker/admit/authz.py: paste the output of\n"
        "  .venv/bin/python -c "
        "'from xhpc.broker.admit.authz import markdown_table as t; print(t())'"
    )
    for rule in authz.RULES:
        assert f"`{rule.method} {rule.path}`" in shown


def _key(key_id: str) -> KeyView | None:
    keys = {
        "0123456789ab": KeyView(key_id="0123456789ab", user="bob", account="lab", created_at=NOW),
        "aaaaaaaaaaaa": KeyView(key_id="aaaaaaaaaaaa", user="bob", created_at=NOW, revoked_at=NOW),
    }
    return keys.get(key_id)


def test_a_call_for_a_named_user_acts_as_that_user_and_never_as_an_admin() -> None:
    """The rule behind tests/test_control_authz.py's walk, caller by caller."""
    batches = authz.rule_for("GET", "/v1/batches")
    keys = authz.rule_for("POST", "/v1/keys/{key_id}/revoke")
    assert batches is not None and batches.acts and keys is not None and not keys.acts
    acting = api.acting_caller

    for proxy in (PROXY, ROOT):
        with pytest.raises(XhpcValidationError, match="must name the user it acts for"):
            acting(batches, proxy, None, None, _key)
        bob = acting(batches, proxy, "bob", "0123456789ab", _key)
        assert bob == Caller(
            user="bob", uid=-1, delegated=True, key_id="0123456789ab", account="lab"
        )
        for stolen in ("aaaaaaaaaaaa", "ffffffffffff", "../../x"):
            with pytest.raises(PermissionError, match="no live key"):
                acting(batches, proxy, "bob", stolen, _key)
        with pytest.raises(PermissionError, match="no live key"):
            acting(batches, proxy, "ann", "0123456789ab", _key)  # bob's key, not ann's
        with pytest.raises(PermissionError, match="acts for no one"):
            acting(keys, proxy, "bob", None, _key)
        with pytest.raises(XhpcValidationError, match="invalid acting user"):
            acting(batches, proxy, "../bob", None, _key)
    # The broker's own user naming itself (its CLI): itself, without admin rights here.
    me = acting(batches, ROOT, "root", None, _key)
    assert me is not None and not me.admin and not me.delegated and me.uid == 0
    # Anyone else may name only itself; in-process calls (None) act as whom they name.
    assert acting(batches, MEMBER, "bob", None, _key) == MEMBER
    assert acting(batches, ADMIN, "ann", None, _key) == ADMIN  # broker.admins keep theirs
    with pytest.raises(PermissionError, match="only the proxy's identity"):
        acting(batches, MEMBER, "ann", None, _key)
    with pytest.raises(PermissionError, match="only the proxy's identity"):
        acting(batches, MEMBER, "bob", "0123456789ab", _key)
    assert acting(batches, None, None, None, _key) is None
    assert acting(batches, None, "bob", None, _key) == Caller(user="bob", uid=-1, delegated=True)
    assert acting(keys, ROOT, None, None, _key) == ROOT
