"""The broker's HTTP surfaces: the control API (unix socket, CLI and proxy) and the agent API."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from xhpc.access import (
    ACTING_KEY_HEADER,
    ACTING_USER_HEADER,
    Caller,
    KeyCreate,
    KeyView,
    UsageLine,
    UsageReport,
)
from xhpc.batch.spec import BatchRequest, BatchView
from xhpc.broker.admit import authz
from xhpc.broker.batches.batch_inputs import CHUNK
from xhpc.broker.desks.agents import Verdict
from xhpc.broker.outlook import overview
from xhpc.broker.relay import RELAY_HEADER, Nonces, Relayed, RelayKey, sign_answer, verify
from xhpc.broker.service import BrokerService
from xhpc.dashboard.overview import DEFAULT_EVENTS, MAX_EVENTS
from xhpc.errors import (
    AdmissionError,
    NotFoundError,
    ValidationError,
    XhpcError,
    plain_message,
)
from xhpc.ids import IdKind, valid
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    DeploymentView,
    NodeInfo,
    PilotReport,
    PilotView,
    ProbeReport,
    ProxyLoad,
    ReplicaView,
    ScalingChange,
    ServeRequest,
    check_name,
)
from xhpc.orphans import OrphanFixRequest
from xhpc.peers import peer_uid, user_name
from xhpc.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from xhpc.records import AdapterAdd, AdapterView
from xhpc.settings import BrokerConfig
from xhpc.weights import CacheCopy, CachePrune, CachePull, CacheRemove
from xhpc.wire import WIRE_HEADER, WIRE_VERSION, peer_wire, read_json, refusal

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CALLER = web.RequestKey("caller", Caller)  # set by the authz middleware
RELAYED = web.RequestKey("relayed", Relayed)  # a relayed call, verified (xhpc.broker.relay)

_STATUS = {ValidationError: 400, AdmissionError: 400, NotFoundError: 404}


def error_response(err: XhpcError) -> web.Response:
    status = next((s for cls, s in _STATUS.items() if type(err) is cls), 500)
    body: dict[str, object] = {"code": err.code, "message": err.message, "hint": err.hint}
    if isinstance(err, AdmissionError):
        body["problems"] = err.problems
    return web.json_response({"error": body}, status=status)


def _json(model: BaseModel) -> web.Response:
    return web.Response(text=model.model_dump_json(), content_type="application/json")


Listed = list[ReplicaView] | list[NodeInfo] | list[DeploymentView]
_LISTED: TypeAdapter[Listed] = TypeAdapter(Listed)


_BATCHES: TypeAdapter[list[BatchView]] = TypeAdapter(list[BatchView])
# Every control call's body is small; a batch's input streams to POST /v1/batch-inputs, within
# broker.batch_input_max_bytes (xhpc.broker.batches.batch_inputs).
MAX_CONTROL_BODY = 1024 * 1024
MAX_LISTED = 10_000  # batches one list call may ask for


class _StopBody(BaseModel):
    target: str = ""  # a deployment or a replica


class _ScaleBody(BaseModel):
    name: str = ""
    replicas: int = -1


def _json_list(items: Listed) -> web.Response:
    return web.Response(body=_LISTED.dump_json(items), content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except XhpcError as err:
        return error_response(err)
    except PydanticValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = plain_message(first["msg"])
        msg = f"{where}: {msg}" if where else msg
        return error_response(ValidationError(msg))
    except json.JSONDecodeError:
        return error_response(ValidationError("request body is not valid JSON"))
    except PermissionError as err:
        return web.json_response({"error": {"code": "forbidden", "message": str(err)}}, status=403)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        # aiohttp's own refusals (a body over client_max_size: 413), as every other error
        code = err.reason.lower().replace(" ", "_")
        body = {"code": code, "message": err.text or err.reason}
        return web.json_response({"error": body}, status=err.status)
    except Exception as err:
        log.exception("internal error handling %s %s", request.method, request.path)
        body = {
            "code": "internal_error",
            "message": f"internal broker error ({type(err).__name__})",
        }
        return web.json_response({"error": body}, status=500)


@web.middleware
async def _wire(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every call names its wire version (``xhpc.wire``): one this broker no longer serves is
    refused (426) before anything else; every answer names this broker's."""
    why = refusal(peer_wire(request.headers.get(WIRE_HEADER)))
    if why is not None:
        body = {"error": {"code": "upgrade_required", "message": why}}
        response: web.StreamResponse = web.json_response(body, status=426)
    else:
        response = await handler(request)
    if not response.prepared:
        response.headers[WIRE_HEADER] = str(WIRE_VERSION)
    return response


def peer_caller(
    request: web.Request, admins: Collection[str] = (), proxy_users: Collection[str] = ()
) -> Caller | None:
    """The Unix user at the other end of the control socket (SO_PEERCRED); None when the
    transport is not a Unix socket (in-process tests). The broker's own user and root are
    admins and the proxy's identity; ``admins`` and ``proxy_users`` add users by name."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    uid = peer_uid(sock)
    return None if uid is None else caller_of(uid, admins, proxy_users)


def caller_of(uid: int, admins: Collection[str], proxy_users: Collection[str]) -> Caller:
    """The caller a uid is on the control socket (or named by a relayed call)."""
    user = user_name(uid)
    trusted = uid in (0, os.getuid())
    return Caller(
        user=user,
        uid=uid,
        admin=trusted or user in admins,
        proxy=trusted or user in proxy_users,
    )


def token_caller(request: web.Request, token_digest: bytes) -> Caller:
    """A control call over TCP (a job of the broker's user): it must present the control token
    (``Authorization: Bearer``); it acts as the broker's user, a member without admin or proxy
    rights (no engine secrets, no keys)."""
    auth = request.headers.get("Authorization", "")
    presented = auth[7:] if auth.startswith("Bearer ") else ""
    if not hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), token_digest):
        raise PermissionError("a control call over TCP needs the broker's control token")
    return Caller(user=user_name(os.getuid()), uid=os.getuid(), admin=False, proxy=False)


def acting_caller(
    rule: authz.Rule | None,
    who: Caller | None,
    named: str | None,
    key_id: str | None,
    key: Callable[[str], KeyView | None],
) -> Caller | None:
    """Who a call acts as (xhpc.broker.admit.authz: ``acts``). ``named``, ``key_id``: the user and
    key the call names (its acting headers); ``key``: the broker's key by its id.

    On an ``acts`` endpoint the proxy's identity must name a user (ValidationError without),
    and the call then acts as exactly that user, never an admin; with a key, one that is live
    and that user's (its account is the caller's). Anyone else may name only itself. Any other
    endpoint refuses a call that names someone (PermissionError)."""
    if named is None and key_id is None:
        if rule is not None and rule.acts and who is not None and who.proxy:
            raise ValidationError(
                f"{rule.method} {rule.path} from the proxy's identity must name the user it "
                f"acts for ({ACTING_USER_HEADER})"
            )
        return who
    if rule is None or not rule.acts:
        raise PermissionError("this endpoint acts for no one: a call naming a user is refused")
    try:
        user = check_name(named or "", "acting user")
    except ValueError as err:
        raise ValidationError(str(err)) from err
    if who is not None and not who.proxy:
        if user != who.user or key_id is not None:
            raise PermissionError(f"only the proxy's identity acts for others; you are {who.user}")
        return who
    account = None
    if key_id is not None:
        found = key(key_id) if valid(IdKind.KEY, key_id) else None
        if found is None or found.revoked_at is not None or found.user != user:
            raise PermissionError(f"no live key {key_id[:40]!r} of {user}")
        account = found.account
    delegated = key_id is not None or who is None or user != who.user
    uid = who.uid if who is not None and not delegated else -1
    return Caller(user=user, uid=uid, delegated=delegated, key_id=key_id, account=account)


def _authorize(
    admins: Collection[str],
    proxy_users: Collection[str],
    token_digest: bytes | None,
    key: Callable[[str], KeyView | None],
    sole: bool = False,
    relay_key: RelayKey | None = None,
) -> Middleware:
    """Every control call passes xhpc.broker.admit.authz's table before its handler (and before its
    body is read); a refusal is a 403 (``forbidden``) through ``_errors``. With
    ``token_digest`` the app serves TCP: the caller is who holds the control token. ``sole``:
    a member's broker (``broker.socket_group``), for its own user, admins and proxy users
    only (``authz.permits``). The caller the handlers see is who the call acts as
    (``acting_caller``). With ``relay_key`` (TCP too) a call a standby relayed
    (xhpc.broker.relay) is verified and acts as the uid it names, as on the socket."""
    sole_uid = os.getuid() if sole else None
    nonces = Nonces()

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        who: Caller | None
        if token_digest is None:
            who = peer_caller(request, admins, proxy_users)
        elif relay_key is not None and RELAY_HEADER in request.headers:
            relayed = await verify(request, relay_key, nonces)
            request[RELAYED] = relayed
            who = caller_of(relayed.uid, admins, proxy_users)
        else:
            who = token_caller(request, token_digest)
        resource = request.match_info.route.resource
        pattern = resource.canonical if resource is not None else None
        authz.check(request.method, pattern, request.path, who, sole_uid)
        named = request.headers.get(ACTING_USER_HEADER)
        key_id = request.headers.get(ACTING_KEY_HEADER)
        who = acting_caller(authz.rule_for(request.method, pattern), who, named, key_id, key)
        if who is not None:
            request[CALLER] = who
        return await handler(request)

    return authorize


def sole_socket(broker: BrokerConfig) -> bool:
    """A member's broker: its socket is shared with a group (the lab gateway's user) and not
    with the whole lab (``shared_socket``); its callers are its user, admins and proxy users."""
    return broker.socket_group is not None and not broker.shared_socket


def _signed(relay_key: RelayKey) -> Middleware:
    """The answer to a relayed call, signed for the relay (xhpc.broker.relay)."""

    @web.middleware
    async def sign(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        relayed = request.get(RELAYED)
        if relayed is not None:
            sign_answer(request, response, relay_key, relayed)
        return response

    return sign


def control_app(
    service: BrokerService, remote_token: str | None = None, relay_key: RelayKey | None = None
) -> web.Application:
    """The control API; on the unix socket by default, or over TCP for the holders of
    ``remote_token`` (the control token) and, with ``relay_key``, for standbys' relays."""
    broker = service.config.broker
    digest = None if remote_token is None else hashlib.sha256(remote_token.encode()).digest()
    signing = [] if relay_key is None else [_signed(relay_key)]
    app = web.Application(
        middlewares=[
            *signing,
            _wire,
            _errors,
            _authorize(
                broker.admins,
                broker.proxy_users,
                digest,
                lambda k: service.keys.view(k),
                sole=sole_socket(broker),
                relay_key=relay_key,
            ),
        ],
        client_max_size=MAX_CONTROL_BODY,
    )
    routes = web.RouteTableDef()

    def caller(request: web.Request) -> Caller | None:
        return request.get(CALLER)

    def batch_id(request: web.Request) -> str:
        """The path's batch id; NotFoundError (404) for one that is not shaped like one."""
        value = request.match_info["batch_id"]
        if not valid(IdKind.BATCH, value):
            raise NotFoundError(f"no batch {value[:80]!r}")
        return value

    @routes.get("/v1/health")
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @routes.post("/v1/serve")
    async def serve(request: web.Request) -> web.Response:
        req = ServeRequest.model_validate_json(await request.read())
        if request.query.get("dry_run") == "1":
            plan = await service.plan(req)
            return web.json_response(
                {"name": plan.name, "engine": plan.engine.value, "scripts": plan.scripts()}
            )
        return _json(await service.serve(req, caller(request)))

    @routes.get("/v1/replicas")
    async def replicas(request: web.Request) -> web.Response:
        return _json_list(service.replicas(all_=request.query.get("all") == "1"))

    @routes.get("/v1/deployments")
    async def deployments(request: web.Request) -> web.Response:
        return _json_list(service.deployments())

    @routes.get("/v1/deployments/{name}")
    async def deployment(request: web.Request) -> web.Response:
        return _json(service.deployment(request.match_info["name"]))

    @routes.post("/v1/stop")
    async def stop(request: web.Request) -> web.Response:
        body = _StopBody.model_validate_json(await request.read())
        return _json_list(await service.stop(body.target, caller(request)))

    @routes.post("/v1/scale")
    async def scale(request: web.Request) -> web.Response:
        body = _ScaleBody.model_validate_json(await request.read())
        return _json(await service.scale(body.name, body.replicas, caller(request)))

    @routes.post("/v1/deployments/{name}/scaling")
    async def scaling(request: web.Request) -> web.Response:
        body = ScalingChange.model_validate_json(await request.read())
        name = request.match_info["name"]
        return _json(await service.autoscaler.change_policy(name, body, caller(request)))

    @routes.get("/v1/nodes")
    async def nodes(_: web.Request) -> web.Response:
        return _json((await service.snapshot()).view())

    @routes.get("/v1/overview")
    async def overview_now(request: web.Request) -> web.Response:
        try:
            events = int(request.query.get("events", str(DEFAULT_EVENTS)))
        except ValueError as err:
            raise ValidationError("events must be a whole number") from err
        if not 0 <= events <= MAX_EVENTS:
            raise ValidationError(f"events must be between 0 and {MAX_EVENTS}")
        return _json(await overview(service, events))

    @routes.get("/v1/routes")
    async def route_table(_: web.Request) -> web.Response:
        return _json(service.routes())

    @routes.post("/v1/proxy/sync")
    async def proxy_sync(request: web.Request) -> web.Response:
        load = read_json(ProxyLoad, await request.read())
        service.drains.heard(load)
        service.lost_jobs.suspect(service.agents.unreachable(load.unreachable))
        return _json(await service.proxies.routes_after(load.table_version, load.wait_s))

    @routes.get("/v1/replicas/{replica_id}/logs")
    async def logs(request: web.Request) -> web.Response:
        try:
            lines = int(request.query.get("lines", "200"))
        except ValueError as err:
            raise ValidationError("lines must be a whole number") from err
        rid = request.match_info["replica_id"]
        return _json(await service.tail_logs(rid, lines, caller(request)))

    @routes.post("/v1/keys")
    async def create_key(request: web.Request) -> web.Response:
        return _json(await service.create_key(KeyCreate.model_validate_json(await request.read())))

    @routes.get("/v1/keys")
    async def list_keys(request: web.Request) -> web.Response:
        return web.Response(
            body=TypeAdapter(list[KeyView]).dump_json(service.keys.all()),
            content_type="application/json",
        )

    @routes.post("/v1/keys/{key_id}/revoke")
    async def revoke_key(request: web.Request) -> web.Response:
        return _json(service.keys.revoke(request.match_info["key_id"]))

    @routes.get("/v1/usage")
    async def usage(request: web.Request) -> web.Response:
        who = caller(request)
        every = await service.usage_desk.lines()
        lines = [u for u in every if who is None or who.admin or u.user == who.user]
        return web.Response(
            body=TypeAdapter(list[UsageLine]).dump_json(lines), content_type="application/json"
        )

    @routes.post("/v1/proxy/grants")
    async def proxy_grants(request: web.Request) -> web.Response:
        report = read_json(UsageReport, await request.read())
        if report.usage:
            service.keys.add_usage(report.usage)
        return _json(service.proxies.grants_for(report.proxy_id))

    @routes.post("/v1/batch-inputs")
    async def batch_input(request: web.Request) -> web.Response:
        who = caller(request)
        owner = who.user if who is not None else service.batches.user
        body = request.content.iter_chunked(CHUNK)
        return _json(await service.batches.inputs.receive(owner, body, request.content_length))

    @routes.post("/v1/batches")
    async def create_batch(request: web.Request) -> web.Response:
        req = BatchRequest.model_validate_json(await request.read())
        return _json(await service.batches.create(req, caller(request)))

    @routes.get("/v1/batches")
    async def list_batches(request: web.Request) -> web.Response:
        raw = request.query.get("limit")
        if raw is not None and not (raw.isdigit() and 1 <= int(raw) <= MAX_LISTED):
            raise ValidationError(f"limit must be a whole number from 1 to {MAX_LISTED}")
        views = service.batches.all(caller(request), int(raw) if raw else None)
        return web.Response(body=_BATCHES.dump_json(views), content_type="application/json")

    @routes.get("/v1/batches/{batch_id}")
    async def get_batch(request: web.Request) -> web.Response:
        return _json(service.batches.get(batch_id(request), caller(request)))

    @routes.get("/v1/batches/{batch_id}/output")
    async def batch_output(request: web.Request) -> web.Response:
        errors = request.query.get("errors") == "1"
        text = service.batches.output(batch_id(request), caller(request), errors)
        return web.json_response({"jsonl": text})

    @routes.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: web.Request) -> web.Response:
        return _json(await service.batches.cancel(batch_id(request), caller(request)))

    @routes.get("/v1/pilots")
    async def pilots(_: web.Request) -> web.Response:
        adapter: TypeAdapter[list[PilotView]] = TypeAdapter(list[PilotView])
        views = service.pilot_desk.views()
        return web.Response(body=adapter.dump_json(views), content_type="application/json")

    @routes.get("/v1/orphans")
    async def orphans(_: web.Request) -> web.Response:
        return _json(await service.orphans())

    @routes.post("/v1/orphans/fix")
    async def fix_orphans(request: web.Request) -> web.Response:
        req = OrphanFixRequest.model_validate_json(await request.read() or b"{}")
        return _json(await service.fix_orphans(req))

    @routes.post("/v1/adapters")
    async def add_adapter(request: web.Request) -> web.Response:
        req = AdapterAdd.model_validate_json(await request.read())
        return _json(service.adapter_desk.add(req.name, req.base, req.path, caller(request)))

    @routes.get("/v1/adapters")
    async def adapters(_: web.Request) -> web.Response:
        views = service.adapter_desk.views()
        body = TypeAdapter(list[AdapterView]).dump_json(views)
        return web.Response(body=body, content_type="application/json")

    @routes.post("/v1/adapters/{name}/rm")
    async def remove_adapter(request: web.Request) -> web.Response:
        return _json(service.adapter_desk.remove(request.match_info["name"], caller(request)))

    @routes.get("/v1/cache")
    async def cache_copies(_: web.Request) -> web.Response:
        adapter: TypeAdapter[list[CacheCopy]] = TypeAdapter(list[CacheCopy])
        copies = await service.cache.copies()
        return web.Response(body=adapter.dump_json(copies), content_type="application/json")

    @routes.post("/v1/cache/rm")
    async def cache_rm(request: web.Request) -> web.Response:
        req = CacheRemove.model_validate_json(await request.read())
        return _json(await service.cache.remove(req))

    @routes.post("/v1/cache/prune")
    async def cache_prune(request: web.Request) -> web.Response:
        req = CachePrune.model_validate_json(await request.read())
        return _json(await service.cache.prune(req))

    @routes.post("/v1/cache/pull")
    async def cache_pull(request: web.Request) -> web.Response:
        req = CachePull.model_validate_json(await request.read())
        return _json(await service.cache.pulls.submit(req))

    @routes.get("/v1/cache/pulls/{pull_id}")
    async def cache_pull_view(request: web.Request) -> web.Response:
        return _json(service.cache.pulls.view(request.match_info["pull_id"]))

    @routes.get("/v1/metrics")
    async def metrics(_: web.Request) -> web.Response:
        text = service.metrics.render(service)
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    app.add_routes(routes)
    return app


_VERDICT_STATUS = {Verdict.OK: 200, Verdict.REGISTER: 409, Verdict.GONE: 410}


def _verdict(verdict: Verdict) -> web.Response:
    return web.json_response({"status": verdict.value}, status=_VERDICT_STATUS[verdict])


def agent_app(service: BrokerService) -> web.Application:
    """Reached by compute nodes. Every call carries the replica's own token."""
    app = web.Application(middlewares=[_wire, _errors], client_max_size=64 * 1024)
    routes = web.RouteTableDef()

    def _token(request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else ""

    @routes.post("/agent/v1/register")
    async def register(request: web.Request) -> web.Response:
        reg = read_json(AgentRegistration, await request.read())
        try:
            row = service.agents.authenticate(reg.replica_id, _token(request))
            if row.job_id != reg.job_id:
                raise PermissionError("registration from a job that is not this replica's")
            # Its adapters first: it takes their traffic the moment it takes its base's.
            async with service.adapter_desk.registering(row, reg.host, reg.port):
                verdict = service.agents.register(reg)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return _verdict(verdict)

    @routes.post("/agent/v1/report")
    async def report(request: web.Request) -> web.Response:
        rep = read_json(AgentReport, await request.read())
        try:
            service.agents.authenticate(rep.replica_id, _token(request))
            verdict = service.agents.report(rep)
            if rep.staged is not None and rep.node is not None and verdict is Verdict.OK:
                service.cache.staged(rep.replica_id, rep.node, rep.staged)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return _verdict(verdict)

    @routes.post("/agent/v1/pilot")
    async def pilot(request: web.Request) -> web.Response:
        report = read_json(PilotReport, await request.read())
        try:
            orders = service.pilot_desk.heartbeat(_token(request), report)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return _json(orders)

    @routes.post("/agent/v1/probe")
    async def probe(request: web.Request) -> web.Response:
        report = read_json(ProbeReport, await request.read())
        try:
            service.agents.probe(_token(request), report)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return web.json_response({"status": "ok"})

    app.add_routes(routes)
    return app
