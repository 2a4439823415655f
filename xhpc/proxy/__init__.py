"""The OpenAI-compatible gateway on the login node (`xhpc proxy`).

A separate process from the broker: it serves from an in-memory routing table that it refreshes
from the broker's control socket, and keeps serving from the last table while the broker is down.
One process (``server.run_proxy``), or a supervisor (``supervisor``) over worker processes
(``worker``, ``python -m xhpc.proxy``) that share its listening socket (decision 0010).
"""

from xhpc.proxy.app import UpstreamFactory, make_app
from xhpc.proxy.app_keys import METRICS_KEY, ROUTER_KEY
from xhpc.proxy.engines.upstream_aiohttp import aiohttp_upstream
from xhpc.proxy.engines.upstream_api import Upstream
from xhpc.proxy.errors import NoReadyReplicaError, UnknownModelError
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.process.server import bound_url, run_proxy
from xhpc.proxy.routes.policies import RequestInfo
from xhpc.proxy.routes.routing import Router
from xhpc.proxy.source import BrokerRouteSource

__all__ = [
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
