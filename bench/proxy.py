"""The gateway's overhead, side by side: direct, the xhpc proxy, nginx proxy_pass, LiteLLM's proxy.

One run, one fast OpenAI-shaped backend (bench/_backend.py: raw asyncio, prepared answers), four
ways to reach it, measured interleaved: every round runs each workload once per contender, the
contenders' order rotated round by round so that drift hits all of them alike (BENCHMARKS.md).

    direct       the load generator talks to the backend itself
    xhpc proxy   the real `xhpc proxy --workers 1` process (the CLI, as operators run it), its
                 routing table served by a stand-in broker on its UNIX socket (POST
                 /v1/proxy/sync answered by the backend process) with one route to the backend
    nginx        the Debian package's nginx, `proxy_pass` to an upstream keep-alive pool,
                 buffering off (as SSE needs), our own config in a temp dir, `daemon off`
    LiteLLM      `litellm --config` (PyPI litellm[proxy], pinned, its own venv .venvs/litellm),
                 the backend as an OpenAI-compatible model (`openai/...`, `api_base`), 1 worker

Workloads (POST /v1/chat/completions):

    c=1, c=64    non-streaming, closed loop on keep-alive connections for a fixed time: latency
                 p50/p99 per round, requests per second; "added" = contender - direct, per round
    SSE 1, 32    streams of ``--tokens`` tokens (role, content, finish, usage chunks and
                 ``data: [DONE]``), one event every ``--interval-ms`` from the backend: TTFT
                 (first event) added over direct, inter-event gap p99 (ITL), and per stream: the
                 event count equal to what the backend sent, the final [DONE], the body
                 byte-exact

Cores: with two or more CPUs the proxies (xhpc, nginx with 1 worker, LiteLLM with 1 worker) are
pinned to one core (`taskset -c P`) and the load generator and the backend to another (`taskset
-c L`), so a proxy has one core to itself ("RPS on one core") and never competes with the client.
The load generator is a raw asyncio HTTP/1.1 client (bench/_http.py); what it can do is printed:
its rate against the backend (direct, both on core L) and against nginx's static answer (`return
200`, nginx on core P), the ceiling of any contender's RPS here.

Every figure is the median of the round values with [min, max]; ratios are of those medians.

    .venv/bin/python bench/proxy.py [--short] [--rounds N] [--json FILE] [--require-all]

Needs nginx and .venvs/litellm (`scripts/setup-bench`); a missing one is left out with a note,
or is an error with --require-all. Exit status 0 when the table was printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import _http  # noqa: E402
from _backend import COMPLETION_BODY, events  # noqa: E402

from xhpc.access import Grants, new_key  # noqa: E402
from xhpc.models import RoutingTable  # noqa: E402

LITELLM_VENV = ROOT / ".venvs" / "litellm"
HOST = "127.0.0.1"
MODEL = "bench"  # the name clients use; every contender maps it to the backend
SERVED_MODEL = "bench-model"
UPSTREAM_KEY = "sk-bench-upstream"

# targets (BENCHMARKS.md)
TARGET_ADDED_P50_MS = 0.3
TARGET_RPS = 6000.0
TARGET_VS_LITELLM = 10.0
TARGET_TTFT_1_MS = 1.0
TARGET_TTFT_32_MS = 2.0
TARGET_ITL_ADDED_MS = 0.5

KEYS = ("direct", "xhpc", "nginx", "litellm")
LABELS = {"direct": "direct", "xhpc": "xhpc proxy", "nginx": "nginx", "litellm": "LiteLLM"}


@dataclass(frozen=True)
class Params:
    rounds: int
    warm_s: float
    c1_s: float
    c64_s: float
    sse1_streams: int
    sse32_per_conn: int
    tokens: int
    interval_ms: float


# Streams: 16 tokens, one event every 10 ms (a fast engine: 100 tokens/s per stream; 32 streams
# are 3,200 events/s through the proxy).
SHORT = Params(
    rounds=2, warm_s=0.15, c1_s=0.4, c64_s=0.8, sse1_streams=6, sse32_per_conn=1, tokens=16,
    interval_ms=10.0,
)  # fmt: skip
FULL = Params(
    rounds=5, warm_s=0.3, c1_s=2.0, c64_s=3.0, sse1_streams=25, sse32_per_conn=3, tokens=16,
    interval_ms=10.0,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench/proxy] {msg}", file=sys.stderr, flush=True)


# --- processes ---------------------------------------------------------------------------------


class Procs:
    """The processes this run started; each leads its own process group, stopped by its id."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, core: int | None
    ) -> subprocess.Popen[bytes]:
        if core is not None:
            argv = ["taskset", "-c", str(core), *argv]
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.tmp / f"{name}.log"
        if not path.exists():
            return ""
        text = path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # our own child's group
        deadline = time.monotonic() + 8.0
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("XHPC_", "LITELLM_", "DATABASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


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
            tail = procs.log_tail(key)
            raise RuntimeError(f"{err}\n--- last lines of its log ---\n{tail}") from err
    log(f"all contenders up in {time.monotonic() - t0:.1f}s: {setup.ports}")
    return setup


def missing(key: str, why: str, setup: Setup, require_all: bool) -> None:
    if require_all:
        raise RuntimeError(f"{LABELS[key]}: {why}")
    setup.notes.append(f"{LABELS[key]} left out: {why}")
    log(setup.notes[-1])


# --- workloads ---------------------------------------------------------------------------------


def chat_body(stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def request_bytes(stream: bool, key: str, path: str = "/v1/chat/completions") -> bytes:
    headers = {"Authorization": f"Bearer {key}"}
    return _http.build_request(path, chat_body(stream), host=HOST, headers=headers)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Plain:
    """One non-streaming run."""

    p50: float
    p99: float
    rps: float
    n: int
    errors: int
    notes: list[str]


@dataclass
class Sse:
    """One streaming run."""

    ttft_p50: float
    itl_p99: float
    streams: int
    events_ok: int
    done_ok: int
    exact: int
    errors: int
    event_counts: list[int]
    notes: list[str]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_plain(
    to: Target, conns: int, warm_s: float, dur_s: float, path: str = "/v1/chat/completions"
) -> Plain:
    port = to.port
    req = request_bytes(False, to.key, path)

    async def go() -> _http.Job:
        job = _http.Job(req, warm_s=warm_s, dur_s=dur_s)
        await _http.run_job(HOST, port, conns, job, timeout_s=warm_s + dur_s + 15)
        return job

    with no_gc():
        job = asyncio.run(go())
    lat = job.latencies
    return Plain(
        quantile(lat, 0.5), quantile(lat, 0.99), job.completed / dur_s, len(lat), job.errors,
        job.error_notes,
    )  # fmt: skip


def run_sse(to: Target, conns: int, per_conn: int, expected: list[bytes]) -> Sse:
    port = to.port
    req = request_bytes(True, to.key)
    exp_body = b"".join(expected)

    async def go() -> _http.Job:
        job = _http.Job(req, stream=True, per_conn=per_conn)
        prime = request_bytes(False, to.key)  # warm connections, as a client's pool has
        await _http.run_job(HOST, port, conns, job, timeout_s=per_conn * 1.0 + 20, prime=prime)
        return job

    with no_gc():
        job = asyncio.run(go())
    ttfts = [s.ttft for s in job.streams if s.ttft is not None]
    gaps = [g for s in job.streams for g in s.gaps()]
    counts = [len(_http.split_events(bytes(s.body))) for s in job.streams]
    done = sum(
        1
        for s in job.streams
        if (ev := _http.split_events(bytes(s.body))) and ev[-1].strip() == _http.DONE_EVENT
    )
    exact = sum(1 for s in job.streams if bytes(s.body) == exp_body)
    return Sse(
        ttft_p50=quantile(ttfts, 0.5),
        itl_p99=quantile(gaps, 0.99),
        streams=len(job.streams),
        events_ok=sum(1 for c in counts if c == len(expected)),
        done_ok=done,
        exact=exact,
        errors=job.errors + (conns * per_conn - len(job.streams)),
        event_counts=sorted(set(counts)),
        notes=job.error_notes,
    )


def smoke(key: str, to: Target, expected: list[bytes], warm_s: float) -> None:
    """A few answers and a stream through the contender, then ``warm_s`` of c=1 load to warm
    it up, before any timing."""
    job = _http.Job(request_bytes(False, to.key), per_conn=5)
    with no_gc():
        asyncio.run(_http.run_job(HOST, to.port, 1, job, timeout_s=30))
    if job.errors or job.completed != 5:
        raise RuntimeError(f"{LABELS[key]}: chat requests failed: {job.error_notes}")
    sse = run_sse(to, 1, 1, expected)
    if sse.errors or sse.streams != 1:
        raise RuntimeError(f"{LABELS[key]}: a streamed chat request failed: {sse.notes}")
    run_plain(to, 1, 0.0, warm_s)


WORKLOADS = ("c1", "c64", "sse1", "sse32")


@dataclass
class Results:
    keys: list[str]
    plain: dict[str, dict[str, list[Plain]]] = field(default_factory=dict)  # wl -> key -> rounds
    sse: dict[str, dict[str, list[Sse]]] = field(default_factory=dict)
    ceiling: dict[str, list[Plain]] = field(default_factory=dict)  # c1/c64 vs nginx static


def run_rounds(setup: Setup, p: Params, expected: list[bytes]) -> Results:
    keys = [k for k in KEYS if k in setup.ports]
    res = Results(keys)
    for wl in ("c1", "c64"):
        res.plain[wl] = {k: [] for k in keys}
    for wl in ("sse1", "sse32"):
        res.sse[wl] = {k: [] for k in keys}
    for key in keys:
        smoke(key, setup.target(key), expected, p.warm_s * 2)
    for r in range(p.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        t0 = time.monotonic()
        for wl in WORKLOADS:
            for key in order:
                to = setup.target(key)
                if wl == "c1":
                    res.plain[wl][key].append(run_plain(to, 1, p.warm_s, p.c1_s))
                elif wl == "c64":
                    res.plain[wl][key].append(run_plain(to, 64, p.warm_s, p.c64_s))
                elif wl == "sse1":
                    res.sse[wl][key].append(run_sse(to, 1, p.sse1_streams, expected))
                else:
                    res.sse[wl][key].append(run_sse(to, 32, p.sse32_per_conn, expected))
        if "nginx" in setup.ports:  # what the load generator alone can do (nginx's `return 200`)
            for wl, conns in (("c1", 1), ("c64", 64)):
                dur = p.c1_s if conns == 1 else p.c64_s
                static = setup.target("nginx")
                run = run_plain(static, conns, p.warm_s, dur / 2, "/bench-static")
                res.ceiling.setdefault(wl, []).append(run)
        log(f"round {r + 1}/{p.rounds} done in {time.monotonic() - t0:.1f}s (order {order})")
    return res


# --- the table ---------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float], scale: float = 1e3, digits: int = 3) -> str:
    if not values:
        return "-"
    m, lo, hi = med(values) * scale, min(values) * scale, max(values) * scale
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def rps_spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{med(values):,.0f} [{min(values):,.0f}, {max(values):,.0f}]"


def added(runs: list[Any], base: list[Any], attr: str) -> list[float]:
    return [getattr(a, attr) - getattr(b, attr) for a, b in zip(runs, base, strict=True)]


def times(x: float, y: float) -> str:
    """x / y as a ratio string."""
    if y <= 0 or x != x or y != y:
        return "n/a"
    return f"{x / y:.2f}x"


def less(proxy: float, other: float) -> str:
    """How many times less `proxy` adds than `other` (both added latencies)."""
    if other != other or proxy != proxy:
        return "n/a"
    if proxy <= 0:
        return "inf (the proxy adds <= 0)"
    return f"{other / proxy:.1f}x less"


@dataclass
class Summary:
    text: str
    data: dict[str, Any]


def summarize(res: Results, setup: Setup, p: Params, cores: Cores, tokens: int) -> Summary:
    keys = res.keys
    lines: list[str] = []
    data: dict[str, Any] = {"contenders": [LABELS[k] for k in keys], "params": p.__dict__}
    out = lines.append
    d_c1, d_c64 = res.plain["c1"]["direct"], res.plain["c64"]["direct"]
    out(
        f"## Gateway overhead, {p.rounds} interleaved rounds "
        f"(median of rounds [min, max]; added = contender - direct, round by round)"
    )
    out("")
    out(f"Cores: {cores.describe()}.")
    vers = ", ".join(f"{k} {v}" for k, v in setup.versions.items())
    if vers:
        out(f"Versions: {vers}.")
    for note in setup.notes:
        out(f"Note: {note}.")
    out("")
    out("### Non-streaming chat completions, keep-alive, closed loop")
    out("")
    out(
        "| contender | c=1 p50 ms | c=1 added p50 ms | c=1 added p99 ms | c=64 RPS "
        "| c=64 added p50 ms | c=64 added p99 ms | errors |"
    )
    out("|---|---|---|---|---|---|---|---|")
    data["plain"] = {}
    for k in keys:
        c1, c64 = res.plain["c1"][k], res.plain["c64"][k]
        errs = sum(r.errors for r in c1 + c64)
        if k == "direct":
            a50 = a99 = b50 = b99 = "—"
        else:
            a50 = spread(added(c1, d_c1, "p50"))
            a99 = spread(added(c1, d_c1, "p99"))
            b50 = spread(added(c64, d_c64, "p50"))
            b99 = spread(added(c64, d_c64, "p99"))
        out(
            f"| {LABELS[k]} | {spread([r.p50 for r in c1])} | {a50} | {a99} "
            f"| {rps_spread([r.rps for r in c64])} | {b50} | {b99} | {errs} |"
        )
        data["plain"][LABELS[k]] = {
            "c1_p50_ms": med([r.p50 for r in c1]) * 1e3,
            "c1_added_p50_ms": med(added(c1, d_c1, "p50")) * 1e3,
            "c1_added_p99_ms": med(added(c1, d_c1, "p99")) * 1e3,
            "c64_rps": med([r.rps for r in c64]),
            "c64_added_p50_ms": med(added(c64, d_c64, "p50")) * 1e3,
            "c64_added_p99_ms": med(added(c64, d_c64, "p99")) * 1e3,
            "errors": errs,
            "error_notes": [n for r in c1 + c64 for n in r.notes][:5],
        }
    if res.ceiling:
        c1s, c64s = res.ceiling.get("c1", []), res.ceiling.get("c64", [])
        out("")
        out(
            f"Load generator (one core): {rps_spread([r.rps for r in c1s])} RPS at c=1 and "
            f"{rps_spread([r.rps for r in c64s])} RPS at c=64 against nginx's static "
            f"`return 200` on the other core; {rps_spread([r.rps for r in d_c1])} / "
            f"{rps_spread([r.rps for r in d_c64])} RPS against the backend directly "
            f"(client and backend sharing its core). A contender near these is limited by "
            f"the load generator, not by itself."
        )
        data["loadgen"] = {
            "static_c1_rps": med([r.rps for r in c1s]),
            "static_c64_rps": med([r.rps for r in c64s]),
            "direct_c1_rps": med([r.rps for r in d_c1]),
            "direct_c64_rps": med([r.rps for r in d_c64]),
        }

    n_events = tokens + 3
    out("")
    out(
        f"### Streaming (SSE): {tokens} tokens = {n_events} events incl. usage and [DONE], "
        f"one every {p.interval_ms:g} ms from the backend"
    )
    out("")
    out(
        "| contender | streams | TTFT p50 ms | TTFT added p50 ms | ITL p99 ms | ITL p99 added ms "
        "| event count = sent | final [DONE] | byte-exact | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    data["sse"] = {}
    for wl, label in (("sse1", "1"), ("sse32", "32")):
        d = res.sse[wl]["direct"]
        for k in keys:
            runs = res.sse[wl][k]
            n = sum(r.streams for r in runs)
            ok = sum(r.events_ok for r in runs)
            done = sum(r.done_ok for r in runs)
            exact = sum(r.exact for r in runs)
            errs = sum(r.errors for r in runs)
            counts = sorted({c for r in runs for c in r.event_counts})
            ttft_add = "—" if k == "direct" else spread(added(runs, d, "ttft_p50"))
            itl_add = "—" if k == "direct" else spread(added(runs, d, "itl_p99"))
            shown_counts = "" if ok == n else f" (got {counts})"
            out(
                f"| {LABELS[k]} | {label} | {spread([r.ttft_p50 for r in runs])} | {ttft_add} "
                f"| {spread([r.itl_p99 for r in runs])} | {itl_add} | {ok}/{n}{shown_counts} "
                f"| {done}/{n} | {exact}/{n} | {errs} |"
            )
            data["sse"].setdefault(wl, {})[LABELS[k]] = {
                "streams": n,
                "events_match": ok,
                "done": done,
                "byte_exact": exact,
                "errors": errs,
                "event_counts": counts,
                "expected_events": n_events,
                "ttft_p50_ms": med([r.ttft_p50 for r in runs]) * 1e3,
                "ttft_added_p50_ms": med(added(runs, d, "ttft_p50")) * 1e3,
                "itl_p99_ms": med([r.itl_p99 for r in runs]) * 1e3,
                "itl_added_p99_ms": med(added(runs, d, "itl_p99")) * 1e3,
            }

    if "xhpc" in keys:
        out("")
        out("### The xhpc proxy against the others (ratios of the medians above)")
        out("")
        out("| measure | xhpc proxy | vs direct | vs nginx | vs LiteLLM |")
        out("|---|---|---|---|---|")
        x_c1 = med(added(res.plain["c1"]["xhpc"], d_c1, "p50"))
        x_c64a = med(added(res.plain["c64"]["xhpc"], d_c64, "p50"))
        x_rps = med([r.rps for r in res.plain["c64"]["xhpc"]])
        d_rps = med([r.rps for r in d_c64])

        def other(key: str, f: Callable[[str], float]) -> float:
            return f(key) if key in keys else float("nan")

        def c1_added(key: str) -> float:
            return med(added(res.plain["c1"][key], d_c1, "p50"))

        def c64_added(key: str) -> float:
            return med(added(res.plain["c64"][key], d_c64, "p50"))

        def rps(key: str) -> float:
            return med([r.rps for r in res.plain["c64"][key]])

        def vs_added(x: float, key: str, f: Callable[[str], float]) -> str:
            o = other(key, f)
            if o != o:
                return "n/a"
            return f"{times(x, o)} nginx's" if key == "nginx" else less(x, o)

        out(
            f"| added p50, c=1 | {x_c1 * 1e3:.3f} ms | +{x_c1 * 1e3:.3f} ms "
            f"| {vs_added(x_c1, 'nginx', c1_added)} | {vs_added(x_c1, 'litellm', c1_added)} |"
        )
        out(
            f"| added p50, c=64 | {x_c64a * 1e3:.3f} ms | +{x_c64a * 1e3:.3f} ms "
            f"| {vs_added(x_c64a, 'nginx', c64_added)} "
            f"| {vs_added(x_c64a, 'litellm', c64_added)} |"
        )
        out(
            f"| RPS, c=64 | {x_rps:,.0f} | {times(x_rps, d_rps)} "
            f"| {times(x_rps, other('nginx', rps))} | {times(x_rps, other('litellm', rps))} |"
        )
        for wl, streams in (("sse1", "1 stream"), ("sse32", "32 streams")):
            base = res.sse[wl]["direct"]

            def ttft_added(key: str, wl: str = wl, base: list[Sse] = base) -> float:
                return med(added(res.sse[wl][key], base, "ttft_p50"))

            x_t = ttft_added("xhpc")
            out(
                f"| SSE TTFT added p50, {streams} | {x_t * 1e3:.3f} ms | +{x_t * 1e3:.3f} ms "
                f"| {vs_added(x_t, 'nginx', ttft_added)} "
                f"| {vs_added(x_t, 'litellm', ttft_added)} |"
            )
        lite_c1 = other("litellm", c1_added)
        x_sse = data["sse"]
        checks = [
            (
                f"added p50 at c=1 ≤ {TARGET_ADDED_P50_MS} ms",
                f"{x_c1 * 1e3:.3f} ms",
                x_c1 * 1e3 <= TARGET_ADDED_P50_MS,
            ),
            (
                f"≥ {TARGET_RPS:,.0f} RPS on one core at c=64",
                f"{x_rps:,.0f} RPS" + (" (pinned)" if cores.proxy is not None else " (unpinned)"),
                x_rps >= TARGET_RPS,
            ),
            (
                f"≥ {TARGET_VS_LITELLM:.0f}x less added latency than LiteLLM (c=1 p50)",
                less(x_c1, lite_c1) if lite_c1 == lite_c1 else "n/a (no LiteLLM)",
                lite_c1 == lite_c1 and (x_c1 <= 0 or lite_c1 / x_c1 >= TARGET_VS_LITELLM),
            ),
            (
                f"SSE TTFT added ≤ {TARGET_TTFT_1_MS} ms (1 stream)",
                f"{x_sse['sse1']['xhpc proxy']['ttft_added_p50_ms']:.3f} ms",
                x_sse["sse1"]["xhpc proxy"]["ttft_added_p50_ms"] <= TARGET_TTFT_1_MS,
            ),
            (
                f"SSE TTFT added p50 ≤ {TARGET_TTFT_32_MS} ms (32 streams)",
                f"{x_sse['sse32']['xhpc proxy']['ttft_added_p50_ms']:.3f} ms",
                x_sse["sse32"]["xhpc proxy"]["ttft_added_p50_ms"] <= TARGET_TTFT_32_MS,
            ),
            (
                f"SSE ITL p99 within +{TARGET_ITL_ADDED_MS} ms (1 / 32 streams)",
                f"{x_sse['sse1']['xhpc proxy']['itl_added_p99_ms']:+.3f} / "
                f"{x_sse['sse32']['xhpc proxy']['itl_added_p99_ms']:+.3f} ms",
                max(
                    x_sse["sse1"]["xhpc proxy"]["itl_added_p99_ms"],
                    x_sse["sse32"]["xhpc proxy"]["itl_added_p99_ms"],
                )
                <= TARGET_ITL_ADDED_MS,
            ),
            (
                "SSE: same event count, final [DONE], byte-exact (every stream)",
                "; ".join(
                    f"{n}: {x['events_match']}/{x['streams']} counts, {x['done']} [DONE], "
                    f"{x['byte_exact']} byte-exact"
                    for w, n in (("sse1", "1 stream"), ("sse32", "32 streams"))
                    for x in (x_sse[w]["xhpc proxy"],)
                ),
                all(
                    x_sse[w]["xhpc proxy"][m] == x_sse[w]["xhpc proxy"]["streams"]
                    for w in ("sse1", "sse32")
                    for m in ("events_match", "done", "byte_exact")
                ),
            ),
        ]
        out("")
        out("### Targets (BENCHMARKS.md)")
        out("")
        out("| target | xhpc proxy | met |")
        out("|---|---|---|")
        for what, value, ok in checks:
            out(f"| {what} | {value} | {'yes' if ok else '**no**'} |")
        data["targets"] = [{"target": w, "value": v, "met": bool(ok)} for w, v, ok in checks]
    return Summary("\n".join(lines), data)


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 2 short rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 2 with --short)")
    ap.add_argument("--tokens", type=int, help="tokens per stream (default 16)")
    ap.add_argument("--interval-ms", type=float, help="between stream events (default 10)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument(
        "--require-all", action="store_true", help="fail when nginx or LiteLLM is not installed"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    given = {"rounds": args.rounds, "tokens": args.tokens, "interval_ms": args.interval_ms}
    p = Params(**{**p.__dict__, **{k: v for k, v in given.items() if v}})
    cores = pick_cores()
    if cores.load is not None:
        os.sched_setaffinity(0, {cores.load})
    log(f"cores: {cores.describe()}")
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-proxy-"))
    procs = Procs(tmp)

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    try:
        setup = start_all(procs, tmp, cores, p, args.require_all)
        expected = events(p.tokens)
        res = run_rounds(setup, p, expected)
        summary = summarize(res, setup, p, cores, p.tokens)
    except RuntimeError as err:
        log(f"ERROR: {err}")
        return 1
    finally:
        procs.stop_all()
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(summary.text)
    print(f"\n(run took {time.monotonic() - t_start:.1f}s)")
    if args.json:
        summary.data["seconds"] = time.monotonic() - t_start
        args.json.write_text(json.dumps(summary.data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
