"""Streams that survive their engine's death, with real engines (decision 0012): two vLLM CPU
engines serving the tiny random Llama on 127.0.0.1, the proxy in this process in front of
them. A greedy completion stream and a greedy chat stream (no max_tokens: the budget is what
the context leaves) start on engine A; A is killed with SIGKILL mid-way; each client's text
must equal an undisturbed run's (asked of engine B directly), as one well-formed stream.

Needs .venvs/vllm (scripts/setup-engines vllm); skipped without it. Marked `engine` (two real
engines at once, ~1-2 min on 2 cores): deselect with `-m "not engine"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.proxy_fakes import free_port, serve
from xhpc.models import Route, RoutingTable
from xhpc.proxy import Router, make_app
from xhpc.proxy.relay.sse import data_of, split_events
from xhpc.settings import ProxyConfig

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"
CACHE = ROOT / "models" / ".continue-vllm-cache"  # kept between runs (git-ignored)
HOST = "127.0.0.1"
SERVED = "tiny"
START_S = 420.0
MAX_MODEL_LEN = 512
KILL_AFTER = 8  # content chunks each client reads before engine A dies

pytestmark = pytest.mark.engine


class Engine:
    def __init__(self, name: str, model: Path, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_HOST_IP": HOST,
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(CACHE / name),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [
            str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", SERVED,
            "--host", HOST, "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
        ]  # fmt: skip
        self.log = log_dir / f"engine-{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL to the engine's whole process group (its own session: the API server and
        the EngineCore process it started), so no orphan outlives the test."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to this engine's own process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self.kill()


@contextlib.contextmanager
def engines(model: Path, log_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    started: list[Engine] = []
    try:
        for name in ("a", "b"):
            started.append(Engine(name, model, log_dir))
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


async def wait_ready(session: aiohttp.ClientSession, engine: Engine) -> None:
    deadline = time.monotonic() + START_S
    while True:
        if engine.proc.poll() is not None:
            pytest.fail(f"engine {engine.name} exited {engine.proc.returncode}:\n{engine.tail()}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(engine.url + "/health") as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            pytest.fail(f"engine {engine.name} not ready after {START_S:.0f}s:\n{engine.tail()}")
        await asyncio.sleep(0.5)


def route(engine: Engine) -> Route:
    return Route(model=SERVED, replica_id=engine.name, url=engine.url, served_model=SERVED)


def chunks_of(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for event in split_events(raw):
        payload = data_of(event)
        assert payload is not None, event
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def text_of(chunks: list[Any], chat: bool) -> str:
    key = "delta" if chat else None
    parts = []
    for chunk in chunks:
        if chunk == "[DONE]":
            continue
        for choice in chunk["choices"]:
            parts.append((choice[key].get("content") or "") if key else choice["text"])
    return "".join(parts)


class Reader:
    """A client reading one stream; ``started`` is set once it read ``KILL_AFTER`` chunks."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        self.session = session
        self.url = url
        self.body = body
        self.raw = b""
        self.started = asyncio.Event()

    async def run(self) -> bytes:
        data = json.dumps(self.body).encode()
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url, data=data, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            async for piece in resp.content.iter_any():
                self.raw += piece
                if self.raw.count(b"\n\n") >= KILL_AFTER + 1:
                    self.started.set()
        self.started.set()
        return self.raw


def assert_whole(raw: bytes, chat: bool) -> list[dict[str, Any]]:
    chunks = chunks_of(raw)
    assert chunks[-1] == "[DONE]" and "[DONE]" not in chunks[:-1], chunks[-3:]
    body = chunks[:-1]
    assert all("error" not in c for c in body), [c for c in body if "error" in c]
    assert len({(c["id"], c["object"], c["created"], c["model"]) for c in body}) == 1
    finishes = [ch["finish_reason"] for c in body for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    if chat:
        roles = [ch for c in body for ch in c["choices"] if "role" in ch["delta"]]
        assert len(roles) == 1
    assert all(ch.get("token_ids") is None for c in body for ch in c["choices"])
    return body


async def test_greedy_streams_survive_sigkill_of_their_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    if not VLLM_PY.exists():
        pytest.skip(f"no {VLLM_PY}: run scripts/setup-engines vllm")
    completion = {
        "model": SERVED,
        "prompt": "The serving plane starts language model engines",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Hello world, hello cluster"}],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    paths = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
    bodies = {"completion": completion, "chat": chat}
    router = Router(config=ProxyConfig(continue_streams=True))
    timeout = aiohttp.ClientTimeout(total=600)
    with engines(tiny_model, tmp_path) as (a, b):
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await wait_ready(session, a)
            await wait_ready(session, b)
            # the undisturbed runs, from engine B alone
            reference = {}
            for kind, body in bodies.items():
                reader = Reader(session, b.url + paths[kind], body)
                reference[kind] = chunks_of(await reader.run())
            router.update(RoutingTable(version=1, models=(SERVED,), routes=(route(a),)))
            async with serve(make_app(router)) as proxy:
                readers = {k: Reader(session, proxy + paths[k], v) for k, v in bodies.items()}
                tasks = {k: asyncio.create_task(r.run()) for k, r in readers.items()}
                await asyncio.wait_for(
                    asyncio.gather(*(r.started.wait() for r in readers.values())), 120
                )
                assert not any(t.done() for t in tasks.values()), "the streams ended too soon"
                both = RoutingTable(version=2, models=(SERVED,), routes=(route(a), route(b)))
                router.update(both)
                os.kill(a.proc.pid, signal.SIGKILL)  # engine A's server, mid-stream
                raws = {k: await asyncio.wait_for(t, 300) for k, t in tasks.items()}
                async with session.get(proxy + "/metrics") as resp:
                    metrics = await resp.text()
    assert a.proc.wait(10) == -signal.SIGKILL
    for kind, raw in raws.items():
        is_chat = kind == "chat"
        got = assert_whole(raw, is_chat)
        want = reference[kind]
        assert text_of(got, is_chat) == text_of(want, is_chat), kind
        usage, want_usage = got[-1]["usage"], want[-2]["usage"]
        assert usage["prompt_tokens"] == want_usage["prompt_tokens"], kind
        assert usage["completion_tokens"] == want_usage["completion_tokens"], kind
        assert usage["total_tokens"] == want_usage["total_tokens"], kind
    assert raws["completion"].count(b'"finish_reason":"length"') == 1
    assert 'xhpc_proxy_retries_total{model="tiny",reason="stream_continued"} 2' in metrics
    assert reference["chat"][-2]["usage"]["completion_tokens"] > 400  # what the context left
