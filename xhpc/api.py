"""The Python API: a model served from a program, a notebook or an sbatch script.

    import xhpc

    with xhpc.serve("tiny-llama", replicas=2, gpus=1) as dep:
        client = dep.openai()           # the openai SDK, pointed at xhpc's proxy
        ...                             # the deployment is READY and routed here
    # leaving the block stopped it (``keep=True``: it goes on serving)

    dep = xhpc.connect("tiny-llama")    # a deployment that is already running

    with xhpc.local("tiny-llama", gpus=1) as srv:   # inside a job: on its own GPUs, no broker
        client = srv.openai()

``serve`` and ``connect`` take the CLI's code path: the same ``xhpc.client.Client`` calls the
same broker. Errors are xhpc's (``xhpc.errors``: ValidationError, AdmissionError,
NotFoundError, BrokerUnavailableError, XhpcError). The config comes from the same layers as
the CLI's (``XHPC_SITE_CONFIG``, the user's file, ``XHPC_*`` variables) unless a loaded one is
given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from xhpc.catalog import expand_request
from xhpc.client.control import GONE, Client, request_of
from xhpc.client.endpoint import Endpoint
from xhpc.config import load_config, load_user_catalog
from xhpc.engine_config import ModelEngineConfig, engine_config_of
from xhpc.errors import XhpcError
from xhpc.models import DeploymentView, LogsView, ReplicaView, ScaleResult, ServeRequest

if TYPE_CHECKING:
    from xhpc.agent.local import LocalServer
    from xhpc.settings import XhpcConfig

log = logging.getLogger(__name__)

API_KEY_ENV = "XHPC_API_KEY"  # the key a program presents to the proxy when keys are on


class Deployment(Endpoint):
    """A deployment on the user's broker. Use it as a context manager to stop it at the end of
    the block (a deployment from ``connect``, or made with ``keep=True``, is left running)."""

    def __init__(
        self,
        client: Client,
        name: str,
        proxy_url: str,
        api_key: str,
        *,
        keep: bool,
        fallbacks: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.name = name
        self.base_url = f"{proxy_url}/v1"  # the OpenAI-compatible endpoint that serves it
        self.fallbacks = tuple(f"{url}/v1" for url in fallbacks)  # the other gateways
        self.api_key = api_key
        self.keep = keep

    def __repr__(self) -> str:
        return f"Deployment({self.name!r}, base_url={self.base_url!r})"

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.keep:
            self.stop()

    def status(self) -> DeploymentView:
        """The deployment as the broker sees it now: its replicas, states and reasons."""
        return self.client.deployment(self.name)

    def wait(self, timeout_s: float = 900.0) -> DeploymentView:
        """Block until every live replica is READY and every proxy routes it; XhpcError when
        one fails or after ``timeout_s`` (the deployment keeps going)."""
        return self.client.wait_ready(self.status(), timeout_s)

    def scale(self, replicas: int, *, wait: bool = True, timeout_s: float = 900.0) -> ScaleResult:
        """Scale to ``replicas``: new ones placed and started (READY before this returns with
        ``wait``), or the least loaded drained and stopped."""
        result = self.client.scale(self.name, replicas)
        if wait and (result.added or result.removed):
            self.client.wait_scaled(result, timeout_s)
        return result

    def replicas(self) -> list[ReplicaView]:
        return [r for r in self.status().replicas if r.state not in GONE]

    def logs(self, lines: int = 200) -> dict[str, LogsView]:
        """Each live replica's job output and engine log (the last ``lines`` lines)."""
        return {r.replica_id: self.client.logs(r.replica_id, lines) for r in self.replicas()}

    def stop(self, *, wait: bool = True, timeout_s: float = 120.0) -> list[ReplicaView]:
        """Drain and stop every replica and end the deployment."""
        rows = self.client.stop(self.name)
        return self.client.wait_stopped(rows, self.name, timeout_s) if wait else rows


def serve(
    model: str,
    *,
    name: str | None = None,
    replicas: int = 1,
    gpus: int | None = None,
    engine: str | None = None,
    partition: str | None = None,
    time: str | None = None,
    engine_args: Sequence[str] = (),
    wait: bool = True,
    timeout_s: float = 900.0,
    keep: bool = False,
    api_key: str | None = None,
    config: XhpcConfig | None = None,
    **options: Any,
) -> Deployment:
    """Serve ``model`` (a catalog name, the site's or your own, or a local model directory) as
    ``xhpc serve`` does (``gpus``: the catalog model's, else 1) and, with ``wait``, return once
    it is READY and routed by the proxy (the first request is answered). ``options`` are the
    rest of ``ServeRequest``'s fields (``nodelist``, ``gpu_type``, ``restart``, ``run_for``,
    ``pilot``, ``pd``, ...). When the wait fails, a deployment this call made is stopped again
    unless ``keep``."""
    fields: dict[str, object] = {
        "model": model,
        "name": name,
        "replicas": replicas,
        "gpus": 1 if gpus is None else gpus,
        "engine": engine,
        "partition": partition,
        "time": time,
        "engine_args": tuple(engine_args),
        **options,
    }
    req = request_of(ServeRequest, fields, lambda field: f"{field}=")
    cfg = config if config is not None else load_config()[0]
    # the catalog's defaults; a member's own model is sent as the request for its weights
    req, warning = expand_request(req, cfg, load_user_catalog(), gpus_given=gpus is not None)
    if warning:
        log.warning("%s", warning)
    client = Client.of_state_dir(cfg.resolved_state_dir)
    view = client.serve(req)
    dep = _deployment(client, view.name, cfg, api_key, keep=keep)
    if wait:
        try:
            client.wait_ready(view, timeout_s)
        except BaseException:
            if not keep:
                dep.stop(wait=False)
            raise
    return dep


def connect(
    name: str, *, api_key: str | None = None, config: XhpcConfig | None = None
) -> Deployment:
    """A deployment that is already running (NotFoundError when there is none by ``name``);
    leaving a ``with`` block over it does not stop it."""
    cfg = config if config is not None else load_config()[0]
    client = Client.of_state_dir(cfg.resolved_state_dir)
    view = client.deployment(name)
    return _deployment(client, view.name, cfg, api_key, keep=True)


def local(
    model: str,
    *,
    gpus: int = 1,
    engine: str | None = None,
    engine_args: Sequence[str] = (),
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float | None = None,
    log_file: str | os.PathLike[str] | None = None,
    config: XhpcConfig | None = None,
    engine_config: Mapping[str, Any] | None = None,
) -> LocalServer:
    """Serve ``model`` inside this job's allocation, with no broker: the engine starts on
    ``gpus`` of the job's GPUs (idle-first; servers of one job never share one) and answers on
    this node, at ``host`` (``0.0.0.0``: every address; the URL then names this node). Returns
    once a real request succeeded; stop it with ``stop()`` or by leaving a ``with`` block.
    Requests need its own key (``.api_key``, used by ``.openai()``). ``engine_config``: how
    the engine serves the model (the keys of a catalog entry's ``engine_config``; None: the
    site catalog entry's), checked against the engine's own options before it starts."""
    from xhpc.agent.local import LocalServer, local_engine

    cfg = config if config is not None else load_config()[0]
    engine_run = local_engine(
        model,
        cfg,
        gpus=gpus,
        engine=engine,
        engine_args=tuple(engine_args),
        name=name,
        host=host,
        port=port,
        timeout_s=timeout_s,
        log_file=Path(log_file) if log_file is not None else None,
        engine_config=_engine_config(engine_config),
    )
    return LocalServer(engine_run).start()


def _engine_config(fields: Mapping[str, Any] | None) -> ModelEngineConfig | None:
    return None if fields is None else engine_config_of(fields, "engine_config")


def _deployment(
    client: Client, name: str, cfg: XhpcConfig, api_key: str | None, *, keep: bool
) -> Deployment:
    key = api_key or os.environ.get(API_KEY_ENV) or ""
    if not key and cfg.proxy.auth != "none":
        raise XhpcError(
            "the proxy wants an API key",
            hint=f"pass api_key=... or set {API_KEY_ENV} (`xhpc keys create --user $USER`)",
        )
    # The site's gateways, one per login node (`[proxy] gateways`): the first, then the others.
    gateways = tuple(url.rstrip("/") for url in cfg.proxy.gateways) or (_own_gateway(client, cfg),)
    return Deployment(client, name, gateways[0], key or "unused", keep=keep, fallbacks=gateways[1:])


def _own_gateway(client: Client, cfg: XhpcConfig) -> str:
    """The gateway of this config's ``[proxy] host`` and ``port``, as this host reaches it."""
    host = cfg.proxy.host
    remote = client.transport.remote_host  # None on the login node (the unix socket)
    if host in ("0.0.0.0", "", "::"):
        host = remote or "127.0.0.1"  # every address: the one this host reached the broker on
    elif remote is not None and (host == "localhost" or host.startswith("127.")):
        raise XhpcError(
            f"the proxy listens on {host}, which this node cannot reach",
            hint="set [proxy] host to an address compute nodes reach, or list the site's "
            "gateways in [proxy] gateways (docs/pipelines.md)",
        )
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if cfg.proxy.tls is not None else "http"
    return f"{scheme}://{host}:{cfg.proxy.port}"


__all__ = ["API_KEY_ENV", "Deployment", "connect", "local", "serve"]
