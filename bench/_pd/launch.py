"""Starting what a run measures: the prefill and decode engines (NixlConnector, CPU buffers)
and a plain single instance, the stand-in broker (bench/_backend.py answering the xhpc proxy's
sync and grants on its UNIX socket), `xhpc proxy --workers 1` with one PD unit of two routes,
and vLLM's toy PD proxy over the same pair; every one waited for, its log shown if it exits.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import Procs, clean_env, free_port
from xhpc.access import Grants
from xhpc.models import RoutingTable

from .params import BLOCK, HOST, MODEL, MODEL_DIR, TOY_PROXY, VLLM_CACHE, VLLM_PY, log

BENCH = Path(__file__).resolve().parent.parent
DROP_ENV = ("XHPC_", "VLLM_", "UCX_", "OPENAI_", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), b""


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, procs: Procs) -> None:
    deadline = time.monotonic() + timeout_s
    proc = procs.procs[what]
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what}: exited with status {proc.returncode}\n--- last lines of its log ---\n"
                f"{procs.log_tail(what)}"
            )
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what}: not ready after {timeout_s:.0f}s\n--- last lines of its log ---\n"
                f"{procs.log_tail(what)}"
            )
        time.sleep(0.25)


@dataclass
class Setup:
    prefill: int = 0  # HTTP ports
    decode: int = 0
    plain: int = 0
    ports: dict[str, int] = field(default_factory=dict)  # contender -> port
    versions: dict[str, str] = field(default_factory=dict)
    start_s: float = 0.0


def engine_argv(port: int, role: str | None) -> list[str]:
    argv = [
        str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
        "--served-model-name", MODEL, "--host", HOST, "--port", str(port), "--enforce-eager",
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
        "--dtype", "float32", "--block-size", str(BLOCK), "--no-enable-prefix-caching",
    ]  # fmt: skip
    if role is not None:
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return argv


def engine_env(side_channel_port: int | None) -> dict[str, str]:
    env = clean_env(
        DROP_ENV,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        VLLM_HOST_IP=HOST,
        VLLM_CACHE_ROOT=str(VLLM_CACHE),
    )
    if side_channel_port is not None:
        env.update(
            UCX_TLS="tcp,self,sm",
            VLLM_NIXL_SIDE_CHANNEL_HOST=HOST,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port),
        )
    return env


def broker_answers(prefill: int, decode: int) -> dict[str, Any]:
    """The stand-in broker's answers: one PD unit of MODEL (a prefill and a decode route) and no
    keys (the proxy runs with auth "none"). Checked with xhpc's own models, so a change of their
    shape fails here, clearly."""
    routes = [
        {
            "model": MODEL,
            "replica_id": f"bench-pd-u0-{role}",
            "url": f"http://{HOST}:{port}",
            "served_model": MODEL,
            "role": role,
            "unit": "bench-pd-u0",
        }
        for role, port in (("prefill", prefill), ("decode", decode))
    ]
    table = {"version": 1, "models": [MODEL], "routes": routes}
    return {
        "/v1/proxy/sync": RoutingTable.model_validate(table).model_dump(mode="json"),
        "/v1/proxy/grants": Grants.model_validate({}).model_dump(mode="json"),
    }


def start_all(procs: Procs, tmp: Path) -> Setup:
    setup = Setup()
    t0 = time.monotonic()
    setup.prefill, setup.decode, setup.plain = free_port(), free_port(), free_port()
    side_p, side_d = free_port(), free_port()
    procs.start("prefill", engine_argv(setup.prefill, "kv_producer"), engine_env(side_p))
    procs.start("decode", engine_argv(setup.decode, "kv_consumer"), engine_env(side_d))
    procs.start("plain", engine_argv(setup.plain, None), engine_env(None))

    # the stand-in broker (bench/_backend.py: its HTTP side is not used) and the xhpc proxy
    state = tmp / "xhpc-state"
    state.mkdir()
    answers = tmp / "broker-answers.json"
    answers.write_text(json.dumps(broker_answers(setup.prefill, setup.decode)))
    ready = tmp / "broker.port"
    procs.start(
        "broker",
        [
            sys.executable, str(BENCH / "_backend.py"), "--port", "0", "--ready-file", str(ready),
            "--broker-socket", str(state / "broker.sock"), "--broker-answers", str(answers),
        ],
        clean_env(DROP_ENV),
    )  # fmt: skip
    cfg = tmp / "xhpc-user.toml"
    cfg.write_text('[proxy]\nauth = "none"\n')
    setup.ports["xhpc"] = free_port()
    env = clean_env(
        DROP_ENV,
        XHPC_STATE_DIR=str(state),
        XHPC_PROXY_HOST=HOST,
        XHPC_PROXY_PORT=str(setup.ports["xhpc"]),
        XHPC_USER_CONFIG=str(cfg),
    )
    wait_until(ready.exists, 15, "broker", procs)
    procs.start("xhpc", [sys.executable, "-m", "xhpc", "proxy", "--workers", "1"], env)

    setup.ports["toy"] = free_port()
    argv = [
        str(VLLM_PY), str(TOY_PROXY), "--host", HOST, "--port", str(setup.ports["toy"]),
        "--prefiller-hosts", HOST, "--prefiller-ports", str(setup.prefill),
        "--decoder-hosts", HOST, "--decoder-ports", str(setup.decode),
    ]  # fmt: skip
    procs.start("toy", argv, clean_env(DROP_ENV, PYTHONUNBUFFERED="1"))

    def xhpc_ready() -> bool:
        status, body = http_get(setup.ports["xhpc"], "/health")
        return status == 200 and json.loads(body).get("routes", 0) >= 2

    wait_until(xhpc_ready, 30, "xhpc", procs)
    wait_until(lambda: http_get(setup.ports["toy"], "/healthcheck")[0] == 200, 60, "toy", procs)
    for name, port in (
        ("prefill", setup.prefill),
        ("decode", setup.decode),
        ("plain", setup.plain),
    ):

        def healthy(port: int = port) -> bool:
            return http_get(port, "/health")[0] == 200

        wait_until(healthy, 240, name, procs)
    setup.start_s = time.monotonic() - t0
    log(f"engines and proxies up in {setup.start_s:.1f}s")
    setup.versions["vllm"] = subprocess.run(
        [str(VLLM_PY), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    digest = hashlib.sha256(TOY_PROXY.read_bytes()).hexdigest()
    setup.versions["toy proxy"] = f"toy_proxy_server.py sha256 {digest[:12]}"
    return setup
