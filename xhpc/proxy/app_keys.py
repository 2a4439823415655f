"""The gateway app's own state, as typed keys of its ``web.Application``: what the modules
around the app (the route source, the worker) read from it without importing the app."""

from __future__ import annotations

from aiohttp import web

from xhpc.proxy.broker_metrics import BrokerSections
from xhpc.proxy.metrics import ProxyMetrics
from xhpc.proxy.routes.routing import Router

ROUTER_KEY = web.AppKey("xhpc_router", Router)
METRICS_KEY = web.AppKey("xhpc_metrics", ProxyMetrics)
BROKERS_KEY = web.AppKey("xhpc_broker_metrics", BrokerSections)  # the brokers' part of /metrics
