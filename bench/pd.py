"""The PD route, side by side: xhpc's two-phase route vs vLLM's own toy PD proxy, same 1P1D pair.

One run, one prefill/decode pair of real vLLM CPU engines (``.venvs/vllm``, the random-weights
models/tiny-llama, ``NixlConnector`` with ``kv_buffer_device: cpu``, 32-token blocks, as
TESTBED.md and xhpc/agent/engines.py run them), two proxies in front of the same pair:

    xhpc proxy      the real `xhpc proxy` process (the CLI, as operators run it), `[proxy] auth =
                    "none"`, its routing table served by a stand-in broker on its UNIX socket
                    (bench/_backend.py answers POST /v1/proxy/sync and /v1/proxy/grants): two
                    routes of one PD unit, role "prefill" -> P and role "decode" -> D
                    (xhpc/proxy/pd.py, decision 0009)
    vLLM toy proxy  vLLM's own example disaggregation proxy, tests/v1/kv_connector/
                    nixl_integration/toy_proxy_server.py of vLLM's sdist (never committed here:
                    scripts/setup-bench extracts it to .venvs/vllm-toy-proxy/), run with
                    .venvs/vllm's python, pointed at the same P and D

Both follow the same protocol (prefill leg with max_tokens 1 and a kv_transfer_params request,
decode leg with P's params), so the difference is what each proxy costs per request.

Workload: chat completions whose prompts span several 32-token KV blocks (a prompt within one
block transfers nothing, TESTBED.md), greedy (temperature 0), ``max_tokens`` 16; four
workloads: non-streaming and streaming, at concurrency 1 and 4 (closed loop). Every (round,
workload) has its own prompts, sent through both contenders. Measured interleaved
(BENCHMARKS.md): in every round each workload runs once per contender, the contenders' order
alternating round by round. Both engines run with
``--no-enable-prefix-caching``: every request does its full prefill on P and moves all its
blocks to D, whichever contender sent the prompt first (with prefix caching the second
contender would find the prompt cached on D and move nothing).

Figures: per run (one workload, one contender, one round) latency p50/p90 (request sent -> the
answer complete at the client; nearest rank) and for streams TTFT p50 (the first content token);
"added" = xhpc - toy for the same prompt in the same round, per request, its median per run;
"ratio" = xhpc p50 / toy p50 per run. Each figure is the median of the round values [min, max].

Correctness: every answer's text (streams: the content deltas joined) equals the other
contender's for the same prompt, and the answer of a plain single vLLM instance (same model and
flags, no KV connector; started with the pair, stopped once it has answered every prompt
directly). KV: the decode instance's ``vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}`` read before and after every contender's run: the tokens it took from
the transfer rather than computing them, per contender, against the prompts' tokens.

Nothing is pinned: on a 2-CPU machine each NIXL engine busy-polls a core (TESTBED.md), and the
engines, the proxies and the load generator share what is left. Expect noise; the figures are
for docs/performance.md, never asserted on.

    .venv/bin/python bench/pd.py [--short] [--rounds N] [--json FILE] [--keep]

``--short`` (CI, tests/test_bench_pd.py): 2 rounds of fewer prompts, ~1.5-2 min with engine
start. Needs .venvs/vllm with nixl (scripts/setup-engines vllm), the toy proxy
(scripts/setup-bench) and models/tiny-llama (scripts/make-tiny-model, made here if missing).
Exit status 0 when the table was printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from xhpc.access import Grants  # noqa: E402
from xhpc.models import RoutingTable  # noqa: E402

VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"
TOY_PROXY = ROOT / ".venvs" / "vllm-toy-proxy" / "toy_proxy_server.py"
MODEL_DIR = ROOT / "models" / "tiny-llama"
MAKE_MODEL = ROOT / "scripts" / "make-tiny-model"
# vLLM's cache (its model-inspection results, kept across runs: a cold one costs every engine a
# subprocess at start), next to the model, git-ignored
VLLM_CACHE = ROOT / "models" / ".tiny-llama-vllm-cache"
HOST = "127.0.0.1"
MODEL = "tiny-pd"  # engines serve it under this name, clients ask for it through both proxies
BLOCK = 32  # the CPU backend's KV block size
KEYS = ("toy", "xhpc")  # the baseline first
LABELS = {"toy": "vLLM toy proxy", "xhpc": "xhpc proxy"}
KV_COUNTER = "vllm:prompt_tokens_by_source_total"
KV_SOURCE = 'source="external_kv_transfer"'


@dataclass(frozen=True)
class Params:
    rounds: int
    c1_prompts: int  # prompts per concurrency-1 workload (each of stream / non-stream)
    c4_prompts: int  # prompts per concurrency-4 workload
    prompt_words: int
    max_tokens: int


SHORT = Params(rounds=2, c1_prompts=4, c4_prompts=8, prompt_words=40, max_tokens=16)
FULL = Params(rounds=5, c1_prompts=12, c4_prompts=24, prompt_words=40, max_tokens=16)


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    concurrency: int
    stream: bool


WORKLOADS = (
    Workload("c1", "c=1", 1, False),
    Workload("c1-sse", "c=1 stream", 1, True),
    Workload("c4", "c=4", 4, False),
    Workload("c4-sse", "c=4 stream", 4, True),
)


def log(msg: str) -> None:
    print(f"[bench/pd] {msg}", file=sys.stderr, flush=True)


# --- processes ---------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: killed when this process dies, even by SIGKILL (a CI timeout)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Procs:
    """The processes this run started; each leads its own process group, stopped by its id."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
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
                preexec_fn=_die_with_parent,  # no threads yet
            )
        finally:
            out.close()
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.tmp / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *names: str) -> None:
        procs = [(n, p) for n, p in self.procs.items() if not names or n in names]
        for _, proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # our own child's group
        deadline = time.monotonic() + 15.0
        for name, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            del self.procs[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("XHPC_", "VLLM_", "UCX_", "OPENAI_", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


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
        clean_env(),
    )  # fmt: skip
    cfg = tmp / "xhpc-user.toml"
    cfg.write_text('[proxy]\nauth = "none"\n')
    setup.ports["xhpc"] = free_port()
    env = clean_env(
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
    procs.start("toy", argv, clean_env(PYTHONUNBUFFERED="1"))

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


# --- workload ----------------------------------------------------------------------------------

TEXT = (
    "the cluster schedules jobs across nodes while each engine reads its prompt and writes "
    "tokens back to the client through a proxy that knows which replica holds which prefix of "
    "every long document so that a second request finds the blocks already computed and only "
    "the new question costs time on the accelerator memory bandwidth decides decode speed while "
    "compute bounds prefill for long inputs a heterogeneous job starts both halves together or "
    "not at all and the network carries the key value cache between them over tcp or rdma"
)
WORDS = TEXT.split()


def make_prompts(p: Params, seed: int = 2026) -> dict[tuple[int, str], list[str]]:
    """Prompts per (round, workload): distinct everywhere, the same for both contenders."""
    rng = random.Random(seed)
    out: dict[tuple[int, str], list[str]] = {}
    for r in range(-1, p.rounds):  # round -1: warm-up
        for wl in WORKLOADS:
            n = p.c1_prompts if wl.concurrency == 1 else p.c4_prompts
            out[(r, wl.key)] = [
                f"Request {r + 1}.{wl.key}.{i}: "
                + " ".join(rng.choice(WORDS) for _ in range(p.prompt_words))
                for i in range(n)
            ]
    return out


def chat_body(prompt: str, p: Params, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": p.max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Answer:
    latency: float = float("nan")
    ttft: float | None = None
    text: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False  # streams: the final data: [DONE] arrived
    error: str | None = None


async def ask(
    session: aiohttp.ClientSession, port: int, prompt: str, p: Params, stream: bool
) -> Answer:
    ans = Answer()
    body = chat_body(prompt, p, stream)
    t0 = time.perf_counter()
    try:
        async with session.post(f"http://{HOST}:{port}/v1/chat/completions", json=body) as resp:
            if not stream:
                raw = await resp.read()
                ans.latency = time.perf_counter() - t0
                if resp.status != 200:
                    ans.error = f"HTTP {resp.status}: {raw[:200]!r}"
                    return ans
                data = json.loads(raw)
                ans.text = data["choices"][0]["message"]["content"]
                usage = data.get("usage") or {}
                ans.prompt_tokens = usage.get("prompt_tokens")
                ans.completion_tokens = usage.get("completion_tokens")
                return ans
            if resp.status != 200:
                raw = await resp.read()
                ans.latency = time.perf_counter() - t0
                ans.error = f"HTTP {resp.status}: {raw[:200]!r}"
                return ans
            parts: list[str] = []
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk.replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data_s = line[5:].strip()
                        if data_s == b"[DONE]":
                            ans.done = True
                            continue
                        obj = json.loads(data_s)
                        if "error" in obj:
                            ans.error = f"error event: {str(obj['error'])[:200]}"
                        for choice in obj.get("choices") or ():
                            piece = (choice.get("delta") or {}).get("content")
                            if piece:
                                if ans.ttft is None:
                                    ans.ttft = time.perf_counter() - t0
                                parts.append(piece)
                        if obj.get("usage"):
                            ans.prompt_tokens = obj["usage"].get("prompt_tokens")
                            ans.completion_tokens = obj["usage"].get("completion_tokens")
            ans.latency = time.perf_counter() - t0
            ans.text = "".join(parts)
            if not ans.done and ans.error is None:
                ans.error = "stream ended without data: [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as err:
        ans.latency = time.perf_counter() - t0
        ans.error = f"{type(err).__name__}: {err}"[:300]
    return ans


async def run_prompts(
    session: aiohttp.ClientSession,
    port: int,
    prompts: list[str],
    p: Params,
    concurrency: int,
    stream: bool,
) -> list[Answer]:
    """Closed loop: ``concurrency`` workers, each sends the next prompt once its answer is in."""
    answers: list[Answer] = [Answer() for _ in prompts]
    todo = iter(range(len(prompts)))

    async def worker() -> None:
        for i in todo:
            answers[i] = await ask(session, port, prompts[i], p, stream)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


async def kv_tokens(session: aiohttp.ClientSession, port: int) -> float:
    """The decode instance's prompt tokens taken from the KV transfer, so far."""
    async with session.get(f"http://{HOST}:{port}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(KV_COUNTER + "{") and KV_SOURCE in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def pd_handoffs(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """xhpc proxy's handoffs by kv_params (true: P returned kv_transfer_params)."""
    async with session.get(f"http://{HOST}:{port}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("xhpc_proxy_pd_handoffs_total{"):
            kind = "true" if 'kv_params="true"' in line else "false"
            out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Run:
    """One workload through one contender in one round."""

    round: int
    workload: str
    contender: str
    answers: list[Answer]
    kv_tokens: float  # the decode instance's counter, after - before


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)
    reference: dict[tuple[int, str], list[Answer]] = field(default_factory=dict)
    handoffs: dict[str, float] = field(default_factory=dict)
    warmup_errors: list[str] = field(default_factory=list)

    def run(self, r: int, wl: str, key: str) -> Run:
        for run in self.runs:
            if (run.round, run.workload, run.contender) == (r, wl, key):
                return run
        raise KeyError((r, wl, key))


async def measure(setup: Setup, p: Params, procs: Procs) -> Results:
    res = Results()
    prompts = make_prompts(p)
    timeout = aiohttp.ClientTimeout(total=120)
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            k: await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))
            for k in (*KEYS, "plain")
        }
        # the single instance's answers to every prompt (direct, not timed), then it goes
        t0 = time.monotonic()
        for (r, wl_key), texts in prompts.items():
            if r >= 0:
                res.reference[(r, wl_key)] = await run_prompts(
                    sessions["plain"], setup.plain, texts, p, 4, False
                )
        bad = [a.error for rs in res.reference.values() for a in rs if a.error]
        if bad:
            raise RuntimeError(f"the single instance failed {len(bad)} prompts: {bad[:3]}")
        log(f"single-instance answers in {time.monotonic() - t0:.1f}s; stopping it")
        procs.stop("plain")

        # warm-up: each contender once through every workload (round -1), not measured
        for wl in WORKLOADS:
            for key in KEYS:
                answers = await run_prompts(
                    sessions[key], setup.ports[key], prompts[(-1, wl.key)][:4], p,
                    wl.concurrency, wl.stream,
                )  # fmt: skip
                res.warmup_errors += [f"{key} {wl.key}: {a.error}" for a in answers if a.error]
        if res.warmup_errors:
            log(f"warm-up errors: {res.warmup_errors[:3]}")
        before = await pd_handoffs(sessions["xhpc"], setup.ports["xhpc"])

        for r in range(p.rounds):
            order = KEYS if r % 2 == 0 else KEYS[::-1]
            t0 = time.monotonic()
            for wl in WORKLOADS:
                for key in order:
                    kv0 = await kv_tokens(sessions[key], setup.decode)
                    answers = await run_prompts(
                        sessions[key], setup.ports[key], prompts[(r, wl.key)], p,
                        wl.concurrency, wl.stream,
                    )  # fmt: skip
                    await asyncio.sleep(0.05)  # let the engine's last stats land
                    kv1 = await kv_tokens(sessions[key], setup.decode)
                    res.runs.append(Run(r, wl.key, key, answers, kv1 - kv0))
            log(f"round {r + 1}/{p.rounds} done in {time.monotonic() - t0:.1f}s (order {order})")
        after = await pd_handoffs(sessions["xhpc"], setup.ports["xhpc"])
        res.handoffs = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("true", "false")}
    return res


# --- the table ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    k = max(0, min(len(vals) - 1, int(-(-q * len(vals) // 1)) - 1))
    return vals[k]


def spread(values: list[float], scale: float = 1e3, digits: int = 1, sign: str = "") -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    m, lo, hi = statistics.median(vals) * scale, min(vals) * scale, max(vals) * scale
    return f"{m:{sign}.{digits}f} [{lo:{sign}.{digits}f}, {hi:{sign}.{digits}f}]"


def ratio_spread(values: list[float]) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3f}x [{min(vals):.3f}, {max(vals):.3f}]"


def med(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


@dataclass
class Summary:
    text: str
    data: dict[str, Any]


def summarize(res: Results, setup: Setup, p: Params) -> Summary:
    lines: list[str] = []
    out = lines.append
    data: dict[str, Any] = {
        "contenders": [LABELS[k] for k in KEYS],
        "params": asdict(p),
        "versions": setup.versions,
        "start_s": setup.start_s,
    }
    ref_tokens = [a.prompt_tokens or 0 for rs in res.reference.values() for a in rs]
    out(
        f"## PD route: xhpc proxy vs vLLM's toy proxy, 1P1D NixlConnector on CPU, "
        f"{p.rounds} interleaved rounds"
    )
    out("")
    out(
        f"Engines: vLLM {setup.versions.get('vllm', '?')} CPU, models/tiny-llama, "
        f"`kv_buffer_device: cpu`, {BLOCK}-token blocks, prefix caching off; "
        f"the toy proxy: {setup.versions.get('toy proxy', '?')}. Prompts "
        f"{min(ref_tokens)}-{max(ref_tokens)} tokens ({min(ref_tokens) // BLOCK}-"
        f"{max(ref_tokens) // BLOCK} whole blocks), max_tokens {p.max_tokens}, greedy. "
        f"{os.cpu_count()} CPUs, nothing pinned (each NIXL engine busy-polls a core): noisy."
    )
    out("")
    out(
        "### Latency (ms; median of round values [min, max]; added = xhpc - toy for the same "
        "prompt in the same round, median per run)"
    )
    out("")
    out(
        "| contender | workload | requests | p50 ms | p90 ms | TTFT p50 ms "
        "| added per request ms | p50 ratio vs toy | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    data["latency"] = {}
    for key in KEYS:
        for wl in WORKLOADS:
            runs = [res.run(r, wl.key, key) for r in range(p.rounds)]
            base = [res.run(r, wl.key, "toy") for r in range(p.rounds)]
            lat = [[a.latency for a in run.answers] for run in runs]
            p50s = [pct(v, 0.5) for v in lat]
            p90s = [pct(v, 0.9) for v in lat]
            ttfts = [pct([a.ttft for a in run.answers if a.ttft is not None], 0.5) for run in runs]
            n = sum(len(run.answers) for run in runs)
            errs = sum(1 for run in runs for a in run.answers if a.error)
            added = [
                med([a.latency - b.latency for a, b in zip(x.answers, y.answers, strict=True)])
                for x, y in zip(runs, base, strict=True)
            ]
            ratios = [
                pct([a.latency for a in x.answers], 0.5) / pct([b.latency for b in y.answers], 0.5)
                for x, y in zip(runs, base, strict=True)
            ]
            is_base = key == "toy"
            out(
                f"| {LABELS[key]} | {wl.label} | {n} | {spread(p50s)} | {spread(p90s)} "
                f"| {spread(ttfts) if wl.stream else '—'} "
                f"| {'— (baseline)' if is_base else spread(added, digits=2, sign='+')} "
                f"| {'—' if is_base else ratio_spread(ratios)} | {errs} |"
            )
            data["latency"].setdefault(LABELS[key], {})[wl.key] = {
                "requests": n,
                "errors": errs,
                "p50_ms": med(p50s) * 1e3,
                "p90_ms": med(p90s) * 1e3,
                "ttft_p50_ms": med(ttfts) * 1e3 if wl.stream else None,
                "added_ms": None if is_base else med(added) * 1e3,
                "added_ms_rounds": None if is_base else [a * 1e3 for a in added],
                "p50_ratio": None if is_base else med(ratios),
            }

    # every request's added latency, all workloads, as one figure
    all_added = [
        a.latency - b.latency
        for r in range(p.rounds)
        for wl in WORKLOADS
        for a, b in zip(
            res.run(r, wl.key, "xhpc").answers, res.run(r, wl.key, "toy").answers, strict=True
        )
    ]
    out("")
    out(
        f"All {len(all_added)} paired requests: xhpc - toy median "
        f"{med(all_added) * 1e3:+.2f} ms, p10 {pct(all_added, 0.1) * 1e3:+.2f} ms, "
        f"p90 {pct(all_added, 0.9) * 1e3:+.2f} ms."
    )
    data["added_all_ms"] = {
        "median": med(all_added) * 1e3,
        "p10": pct(all_added, 0.1) * 1e3,
        "p90": pct(all_added, 0.9) * 1e3,
        "pairs": len(all_added),
    }

    out("")
    out(
        "### Correctness and KV transfer (outputs: text equal for the same prompt; KV: the "
        'decode instance\'s `prompt_tokens_by_source_total{source="external_kv_transfer"}`, '
        "after - before each run)"
    )
    out("")
    out(
        "| contender | requests | errors | output = other contender's | output = single instance "
        "| prompt tokens sent | KV tokens transferred | runs where KV moved |"
    )
    out("|---|---|---|---|---|---|---|---|")
    data["correctness"] = {}
    mismatches: list[dict[str, Any]] = []
    for key in KEYS:
        other = "xhpc" if key == "toy" else "toy"
        n = errs = same_other = same_ref = 0
        kv = 0.0
        moved = 0
        runs = [run for run in res.runs if run.contender == key]
        prompt_tokens = 0
        for run in runs:
            refs = res.reference[(run.round, run.workload)]
            others = res.run(run.round, run.workload, other).answers
            kv += run.kv_tokens
            moved += run.kv_tokens > 0
            for i, (a, o, ref) in enumerate(zip(run.answers, others, refs, strict=True)):
                n += 1
                prompt_tokens += ref.prompt_tokens or 0
                if a.error:
                    errs += 1
                    continue
                same_other += a.text == o.text and o.error is None
                same_ref += a.text == ref.text
                if a.text != ref.text and len(mismatches) < 5:
                    mismatches.append(
                        {
                            "contender": LABELS[key],
                            "round": run.round,
                            "workload": run.workload,
                            "prompt": i,
                            "got": a.text,
                            "single_instance": ref.text,
                        }
                    )
        out(
            f"| {LABELS[key]} | {n} | {errs} | {same_other}/{n} | {same_ref}/{n} "
            f"| {prompt_tokens:,} | {kv:,.0f} | {moved}/{len(runs)} |"
        )
        data["correctness"][LABELS[key]] = {
            "requests": n,
            "errors": errs,
            "match_other": same_other,
            "match_single_instance": same_ref,
            "prompt_tokens": prompt_tokens,
            "kv_tokens": kv,
            "runs": len(runs),
            "runs_kv_moved": moved,
            "error_notes": [a.error for run in runs for a in run.answers if a.error][:5],
        }
    data["mismatches"] = mismatches
    data["xhpc_handoffs"] = res.handoffs
    data["warmup_errors"] = res.warmup_errors
    out("")
    out(
        f"xhpc proxy's own /metrics over the rounds: "
        f"{res.handoffs.get('true', 0):.0f} handoffs with P's kv_transfer_params, "
        f"{res.handoffs.get('false', 0):.0f} without. The single instance: the same engine "
        f"flags without a KV connector, asked directly (non-streaming) for every prompt."
    )
    for m in mismatches:
        out(f"Mismatch: {m}")
    return Summary("\n".join(lines), data)


# --- main --------------------------------------------------------------------------------------


def missing() -> list[str]:
    gone = []
    if not VLLM_PY.exists():
        gone.append(f"{VLLM_PY} (scripts/setup-engines vllm)")
    if not TOY_PROXY.exists():
        gone.append(f"{TOY_PROXY} (scripts/setup-bench)")
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 2 short rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 2 with --short)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    if args.rounds:
        p = Params(**{**asdict(p), "rounds": args.rounds})
    gone = missing()
    if gone:
        log(f"ERROR: not installed: {', '.join(gone)}")
        return 1
    if not (MODEL_DIR / "config.json").exists():
        log(f"making {MODEL_DIR} (scripts/make-tiny-model)")
        subprocess.run([str(MAKE_MODEL)], check=True, stdout=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-pd-"))
    procs = Procs(tmp)

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    try:
        setup = start_all(procs, tmp)
        res = asyncio.run(measure(setup, p, procs))
        summary = summarize(res, setup, p)
    except RuntimeError as err:
        log(f"ERROR: {err}")
        return 1
    finally:
        procs.stop()
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - t_start
    print(summary.text)
    print(f"\n(run took {seconds:.1f}s, {setup.start_s:.1f}s of it starting engines and proxies)")
    if args.json:
        summary.data["seconds"] = seconds
        args.json.write_text(json.dumps(summary.data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
