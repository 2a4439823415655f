"""Starting what a run measures: the backend (bench/_backend.py, also the stand-in broker on
the xhpc proxy's UNIX socket) and the contenders, each from its own config in the run's temp
dir (`xhpc proxy --workers 1`, nginx proxy_pass, LiteLLM), the proxies pinned to one core and
the load generator and the backend to another; a contender that is not installed is left out
with a note, or is an error with ``--require-all``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _http
from _backend import COMPLETION_BODY

from bench._common import Procs, clean_env, free_port
from xhpc.access import Grants, new_key
from xhpc.models import RoutingTable

from .params import HOST, LABELS, LITELLM_VENV, MODEL, SERVED_MODEL, UPSTREAM_KEY, Params, log

BENCH = Path(__file__).resolve().parent.parent
DROP_ENV = ("XHPC_", "LITELLM_", "DATABASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy")


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with status {proc.returncode}")
        try:
            if check():
                return
        except (OSError, ValueError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout_s:.0f}s")
        time.sleep(0.05)


def http_get(port: int, path: str) -> tuple[int, bytes]:
    return asyncio.run(_http.get(HOST, port, path))


@dataclass
class Cores:
    proxy: int | None
    load: int | None

    def describe(self) -> str:
        if self.proxy is None:
            return "not pinned (fewer than 2 CPUs available): all processes share the CPUs"
        return (
            f"proxies (xhpc, nginx master+1 worker, LiteLLM 1 worker) on CPU {self.proxy}; "
            f"load generator and backend on CPU {self.load} (taskset)"
        )


def pick_cores() -> Cores:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or shutil.which("taskset") is None:
        return Cores(None, None)
    return Cores(allowed[0], allowed[1])


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None


def litellm_binary() -> Path | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    return exe if exe.exists() else None


def nginx_conf(tmp: Path, port: int, backend: int) -> str:
    static = COMPLETION_BODY.decode()
    assert "'" not in static and "$" not in static
    temp = {t: tmp / f"nginx-{t}" for t in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return f"""
daemon off;
master_process on;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {tmp}/nginx-access.log combined buffer=64k flush=1s;
    client_body_temp_path {temp["body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    upstream backend {{
        server {HOST}:{backend};
        keepalive 256;
        keepalive_requests 10000000;
    }}
    server {{
        listen {HOST}:{port} backlog=4096;
        location = /bench-static {{
            access_log off;
            default_type application/json;
            return 200 '{static}';
        }}
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


def litellm_config(backend: int, master_key: str) -> dict[str, Any]:
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{SERVED_MODEL}",
                    "api_base": f"http://{HOST}:{backend}/v1",
                    "api_key": UPSTREAM_KEY,
                },
            }
        ],
        "litellm_settings": {"drop_params": True, "num_retries": 0, "request_timeout": 60},
        "general_settings": {"master_key": master_key},
    }


def broker_answers(backend: int, key_id: str, digest: str) -> dict[str, Any]:
    """What the stand-in broker answers the proxy: the routing table (one READY replica of
    MODEL, the backend) and the key grants (the bench's key, owner of MODEL). Both are checked
    with xhpc's own models, so a change of their shape fails here, clearly."""
    table = {
        "version": 1,
        "models": [MODEL],
        "routes": [
            {
                "model": MODEL,
                "replica_id": "bench-r0",
                "url": f"http://{HOST}:{backend}",
                "served_model": SERVED_MODEL,
            }
        ],
    }
    grants = {
        "keys": [{"key_id": key_id, "digest": digest, "user": "bench", "account": "bench"}],
        "access": [{"model": MODEL, "owner": "bench", "account": "bench"}],
    }
    return {
        "/v1/proxy/sync": RoutingTable.model_validate(table).model_dump(mode="json"),
        "/v1/proxy/grants": Grants.model_validate(grants).model_dump(mode="json"),
    }


@dataclass(frozen=True)
class Target:
    port: int
    key: str  # the API key the client sends


@dataclass
class Setup:
    ports: dict[str, int] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    def target(self, key: str) -> Target:
        return Target(self.ports[key], self.api_keys.get(key, self.api_keys["xhpc"]))


def start_all(procs: Procs, tmp: Path, cores: Cores, p: Params, require_all: bool) -> Setup:
    setup = Setup()
    # the backend (and the stand-in broker socket), on the load generator's core
    ready = tmp / "backend.port"
    sock_dir = tmp / "xhpc-state"
    sock_dir.mkdir()
    backend_port = free_port()
    # an xhpc key for the xhpc proxy (auth "keys", the default); the others get it too but
    # ignore it, except LiteLLM, which gets its master key
    key_id, client_key, digest = new_key()
    setup.api_keys["xhpc"] = client_key
    answers = tmp / "broker-answers.json"
    answers.write_text(json.dumps(broker_answers(backend_port, key_id, digest)))
    backend = procs.start(
        "backend",
        [
            sys.executable, str(BENCH / "_backend.py"), "--port", str(backend_port),
            "--ready-file", str(ready), "--tokens", str(p.tokens),
            "--interval-ms", str(p.interval_ms), "--broker-socket", str(sock_dir / "broker.sock"),
            "--broker-answers", str(answers),
        ],
        core=cores.load,
    )  # fmt: skip
    wait_until(ready.exists, 15, "backend", backend)
    setup.ports["direct"] = backend_port

    started: dict[str, tuple[subprocess.Popen[bytes], Callable[[], bool], float]] = {}

    # the xhpc proxy, as operators run it: `xhpc proxy`, routes from the broker socket; one
    # worker process, since the figures are for one core
    port = free_port()
    (tmp / "xhpc-user.toml").write_text("")
    env = clean_env(
        DROP_ENV,
        XHPC_STATE_DIR=str(sock_dir),
        XHPC_PROXY_HOST=HOST,
        XHPC_PROXY_PORT=str(port),
        XHPC_USER_CONFIG=str(tmp / "xhpc-user.toml"),
    )
    argv = [sys.executable, "-m", "xhpc", "proxy", "--workers", "1"]
    proc = procs.start("xhpc", argv, env=env, core=cores.proxy)
    setup.ports["xhpc"] = port

    def xhpc_ready(port: int = port) -> bool:
        status, body = http_get(port, "/health")
        return status == 200 and json.loads(body).get("routes", 0) >= 1

    started["xhpc"] = (proc, xhpc_ready, 30)

    nginx = nginx_binary()
    if nginx is None:
        missing("nginx", "not installed (scripts/setup-bench installs it)", setup, require_all)
    else:
        port = free_port()
        for t in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (tmp / f"nginx-{t}").mkdir()
        conf = tmp / "nginx.conf"
        conf.write_text(nginx_conf(tmp, port, backend_port))
        argv = [nginx, "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)]
        proc = procs.start("nginx", argv, core=cores.proxy)
        setup.ports["nginx"] = port
        version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
        setup.versions["nginx"] = version.rsplit("/", 1)[-1]

        def nginx_ready(port: int = port) -> bool:
            return http_get(port, "/bench-static")[0] == 200

        started["nginx"] = (proc, nginx_ready, 15)

    litellm = litellm_binary()
    if litellm is None:
        missing("litellm", f"no {LITELLM_VENV} (scripts/setup-bench makes it)", setup, require_all)
    else:
        port = free_port()
        cfg = tmp / "litellm.yaml"
        master_key = f"sk-{secrets.token_hex(24)}"  # LiteLLM refuses to start without one
        setup.api_keys["litellm"] = master_key
        cfg.write_text(json.dumps(litellm_config(backend_port, master_key), indent=1))  # YAML
        env = clean_env(
            DROP_ENV,
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            LITELLM_LOG="ERROR",
            LITELLM_MODE="PRODUCTION",
            NO_DOCS="True",
        )
        argv = [
            str(litellm), "--config", str(cfg), "--host", HOST, "--port", str(port),
            "--num_workers", "1",
        ]  # fmt: skip
        proc = procs.start("litellm", argv, env=env, core=cores.proxy)
        setup.ports["litellm"] = port
        py = LITELLM_VENV / "bin" / "python"
        version = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        setup.versions["litellm"] = version

        def litellm_ready(port: int = port) -> bool:
            return http_get(port, "/health/liveliness")[0] == 200

        started["litellm"] = (proc, litellm_ready, 120)

    t0 = time.monotonic()
    for key, (proc, check, timeout_s) in started.items():
        try:
            wait_until(check, timeout_s - (time.monotonic() - t0), LABELS[key], proc)
        except RuntimeError as err:
            tail = procs.log_tail(key, 15)
            raise RuntimeError(f"{err}\n--- last lines of its log ---\n{tail}") from err
    log(f"all contenders up in {time.monotonic() - t0:.1f}s: {setup.ports}")
    return setup


def missing(key: str, why: str, setup: Setup, require_all: bool) -> None:
    if require_all:
        raise RuntimeError(f"{LABELS[key]}: {why}")
    setup.notes.append(f"{LABELS[key]} left out: {why}")
    log(setup.notes[-1])
