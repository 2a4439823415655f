"""The broker's HTTP surfaces: the control API (unix socket, CLI and proxy) and the agent API."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from xhpc.broker.orphans import OrphanFixRequest
from xhpc.broker.service import BrokerService
from xhpc.errors import AdmissionError, NotFoundError, ValidationError, XhpcError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    NodeInfo,
    PilotReport,
    PilotView,
    ProbeReport,
    ProxyLoad,
    ReplicaView,
    ServeRequest,
)

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS = {ValidationError: 400, AdmissionError: 400, NotFoundError: 404}


def error_response(err: XhpcError) -> web.Response:
    status = next((s for cls, s in _STATUS.items() if type(err) is cls), 500)
    body: dict[str, object] = {"code": err.code, "message": err.message, "hint": err.hint}
    if isinstance(err, AdmissionError):
        body["problems"] = err.problems
    return web.json_response({"error": body}, status=status)


def _json(model: BaseModel) -> web.Response:
    return web.Response(text=model.model_dump_json(), content_type="application/json")


def _json_list(items: list[ReplicaView] | list[NodeInfo]) -> web.Response:
    adapter: TypeAdapter[list[ReplicaView] | list[NodeInfo]] = TypeAdapter(
        list[ReplicaView] | list[NodeInfo]
    )
    return web.Response(body=adapter.dump_json(items), content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except XhpcError as err:
        return error_response(err)
    except PydanticValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = f"{where}: {first['msg']}" if where else first["msg"]
        return error_response(ValidationError(msg))
    except json.JSONDecodeError:
        return error_response(ValidationError("request body is not valid JSON"))
    except web.HTTPException:
        raise
    except Exception as err:
        log.exception("internal error handling %s %s", request.method, request.path)
        body = {
            "code": "internal_error",
            "message": f"internal broker error ({type(err).__name__})",
        }
        return web.json_response({"error": body}, status=500)


def control_app(service: BrokerService) -> web.Application:
    app = web.Application(middlewares=[_errors])
    routes = web.RouteTableDef()

    @routes.get("/v1/health")
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @routes.post("/v1/serve")
    async def serve(request: web.Request) -> web.Response:
        req = ServeRequest.model_validate_json(await request.text())
        if request.query.get("dry_run") == "1":
            plan = await service.plan(req)
            return web.json_response(
                {
                    "name": plan.name,
                    "engine": plan.engine.value,
                    "scripts": {r.replica_id: r.script for r in plan.replicas if r.script},
                    "pilot_script": plan.new_pilot.script if plan.new_pilot else None,
                }
            )
        return _json(await service.serve(req))

    @routes.get("/v1/replicas")
    async def replicas(request: web.Request) -> web.Response:
        return _json_list(service.replicas(all_=request.query.get("all") == "1"))

    @routes.get("/v1/deployments/{name}")
    async def deployment(request: web.Request) -> web.Response:
        return _json(service.deployment(request.match_info["name"]))

    @routes.post("/v1/stop")
    async def stop(request: web.Request) -> web.Response:
        target = str((await request.json()).get("target", ""))
        return _json_list(await service.stop(target))

    @routes.post("/v1/scale")
    async def scale(request: web.Request) -> web.Response:
        body = await request.json()
        return _json(await service.scale(str(body.get("name", "")), int(body.get("replicas", -1))))

    @routes.get("/v1/nodes")
    async def nodes(_: web.Request) -> web.Response:
        return _json(await service.snapshot())

    @routes.get("/v1/routes")
    async def route_table(_: web.Request) -> web.Response:
        return _json(service.routes())

    @routes.post("/v1/proxy/sync")
    async def proxy_sync(request: web.Request) -> web.Response:
        service.drains.heard(ProxyLoad.model_validate_json(await request.text()))
        return _json(service.routes())

    @routes.get("/v1/replicas/{replica_id}/logs")
    async def logs(request: web.Request) -> web.Response:
        lines = int(request.query.get("lines", "200"))
        return _json(service.logs(request.match_info["replica_id"], lines))

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
        req = OrphanFixRequest.model_validate_json(await request.text() or "{}")
        return _json(await service.fix_orphans(req))

    app.add_routes(routes)
    return app


def agent_app(service: BrokerService) -> web.Application:
    """Reached by compute nodes. Every call carries the replica's own token."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024)
    routes = web.RouteTableDef()

    def _token(request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else ""

    @routes.post("/agent/v1/register")
    async def register(request: web.Request) -> web.Response:
        reg = AgentRegistration.model_validate_json(await request.text())
        try:
            service.agents.authenticate(reg.replica_id, _token(request))
            service.agents.register(reg)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return web.json_response({"status": "registered"})

    @routes.post("/agent/v1/report")
    async def report(request: web.Request) -> web.Response:
        rep = AgentReport.model_validate_json(await request.text())
        try:
            service.agents.authenticate(rep.replica_id, _token(request))
            known = service.agents.report(rep)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        if not known:
            return web.json_response({"status": "register again"}, status=409)
        return web.json_response({"status": "ok"})

    @routes.post("/agent/v1/pilot")
    async def pilot(request: web.Request) -> web.Response:
        report = PilotReport.model_validate_json(await request.text())
        try:
            orders = service.pilot_desk.heartbeat(_token(request), report)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return _json(orders)

    @routes.post("/agent/v1/probe")
    async def probe(request: web.Request) -> web.Response:
        report = ProbeReport.model_validate_json(await request.text())
        try:
            service.agents.probe(_token(request), report)
        except PermissionError as err:
            return web.json_response({"error": {"message": str(err)}}, status=401)
        return web.json_response({"status": "ok"})

    app.add_routes(routes)
    return app
