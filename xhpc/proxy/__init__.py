"""The OpenAI-compatible gateway on the login node (`xhpc proxy`).

A separate process from the broker: it serves from an in-memory routing table that it refreshes
from the broker's control socket, and keeps serving from the last table while the broker is down.
One process (``server.run_proxy``), or a supervisor (``supervisor``) over worker processes
(``worker``, ``python -m xhpc.proxy``) that share its listening socket (decision 0010).
"""

from xhpc.proxy.app import (
    METRICS_KEY,
    ROUTER_KEY,
    ClientSessionFactory,
    default_session_factory,
    make_app,
)
from xhpc.proxy.errors import NoReadyReplicaError, UnknownModelError
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.policies import RequestInfo
from xhpc.proxy.routing import Router
from xhpc.proxy.server import bound_url, run_proxy
from xhpc.proxy.source import BrokerRouteSource

__all__ = [
    "METRICS_KEY",
    "ROUTER_KEY",
    "BrokerRouteSource",
    "ClientSessionFactory",
    "NoReadyReplicaError",
    "ProxyMetrics",
    "RequestInfo",
    "Router",
    "UnknownModelError",
    "bound_url",
    "default_session_factory",
    "make_app",
    "run_proxy",
]
