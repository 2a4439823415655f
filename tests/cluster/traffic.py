"""Steady traffic through the proxy with every answer checked (the chaos suite's load).

Each worker thread sends chat completions back to back, alternating plain and streamed ones, and
records an :class:`Outcome` per request: a plain answer must be a 200 with the whole completion
(``max_tokens`` tokens: the tiny model always generates exactly that many), ``finish_reason`` and
``usage``; a stream must be a 200 whose events parse, carry text and end with a ``finish_reason``
(and ``[DONE]`` where the engine sends it). Anything else is a failure, kept with its detail, and
a 200 whose body is cut short is a *truncated* failure: the one kind no fault may cause.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_TOKENS = 6


@dataclass(frozen=True)
class Outcome:
    at: float  # monotonic, when the request was sent
    stream: bool
    ok: bool
    status: int
    detail: str = ""
    truncated: bool = False  # a 200 whose answer was cut short


@dataclass
class Traffic:
    proxy_url: str
    model: str
    workers: int = 2
    streams: bool = True
    done_marker: bool = False  # the engine ends streams with [DONE] (vLLM does)
    extra: dict[str, object] = field(default_factory=dict)  # more of the body (vLLM: ignore_eos)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started_at: float = 0.0  # monotonic, when the load began (after the warm-up)
    warm_s: float = 30.0  # how long the warm-up may take (engines across nodes answer slowly)
    key: str = "x"  # the API key sent (any, where the gateway has no keys)

    def __enter__(self) -> Traffic:
        # The fault comes after traffic is established: every proxy worker routes the model
        # (each polls the broker once a second; new connections land on either worker).
        deadline = time.monotonic() + self.warm_s
        streak = 0
        while streak < 8:
            if time.monotonic() > deadline:
                raise AssertionError(f"the proxy does not route {self.model} after {self.warm_s} s")
            streak = streak + 1 if self._one(False, "warm-up").ok else 0
        self.started_at = time.monotonic()
        for i in range(self.workers):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    # -- reading the results ----------------------------------------------------------------
    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def sent(self) -> int:
        return len(self.snapshot())

    def ok_since(self, t: float) -> int:
        return sum(o.ok for o in self.snapshot() if o.at >= t)

    def failures(self, stream: bool | None = None) -> list[Outcome]:
        return [o for o in self.snapshot() if not o.ok and (stream is None or o.stream == stream)]

    def truncated(self) -> list[Outcome]:
        return [o for o in self.snapshot() if o.truncated]

    def summary(self) -> str:
        outs = self.snapshot()
        bad = [o for o in outs if not o.ok]
        shown = "; ".join(
            f"{o.status} at +{o.at - self.started_at:.2f}s {o.detail[:120]}" for o in bad[:5]
        )
        return f"{len(outs)} sent, {len(bad)} failed ({shown})"

    def since_start(self, t: float) -> str:
        """A monotonic time as seconds into the load, for messages."""
        return f"+{t - self.started_at:.2f}s"

    # -- the load ---------------------------------------------------------------------------
    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            stream = self.streams and (n + worker) % 2 == 1
            n += 1
            outcome = self._one(stream, f"worker {worker} request {n}")
            with self._lock:
                self.outcomes.append(outcome)
            if not outcome.ok:
                time.sleep(0.05)  # pacing after an error (e.g. 503 while nothing is READY)

    def _one(self, stream: bool, prompt: str) -> Outcome:
        at = time.monotonic()
        url = urlsplit(self.proxy_url)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
            **self.extra,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(body),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
            )
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as err:
            return Outcome(at, stream, False, 0, f"{type(err).__name__}: {err}", truncated=False)
        finally:
            conn.close()
        if resp.status != 200:
            return Outcome(at, stream, False, resp.status, raw[:300].decode(errors="replace"))
        check = _check_stream if stream else _check_plain
        problem = check(raw, self.done_marker)
        if problem:
            # An error event is an error the client sees; anything else cut short is a lie.
            told = problem.startswith("error event")
            return Outcome(at, stream, False, 200, problem, truncated=not told)
        return Outcome(at, stream, True, 200)


def _check_plain(raw: bytes, _done: bool) -> str:
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        text = choice["message"]["content"]
        usage = data["usage"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return f"unreadable answer ({type(err).__name__}): {raw[:200]!r}"
    if not text or choice.get("finish_reason") not in ("length", "stop"):
        return f"incomplete answer: {raw[:200]!r}"
    if usage.get("completion_tokens") != MAX_TOKENS:
        return f"{usage.get('completion_tokens')} of {MAX_TOKENS} tokens: {raw[:200]!r}"
    return ""


def _check_stream(raw: bytes, done: bool) -> str:
    lines = raw.decode(errors="replace").splitlines()
    events = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    errors = [ev for ev in events if '"error"' in ev]
    if errors:
        return f"error event: {errors[0][:200]}"
    if done and (not events or events[-1] != "[DONE]"):
        return f"stream without [DONE]: {raw[-200:]!r}"
    text = ""
    finish = None
    for ev in events:
        if ev == "[DONE]":
            continue
        try:
            chunk = json.loads(ev)
        except ValueError:
            return f"unreadable event {ev[:100]!r}"
        if "error" in chunk:
            return f"error event: {ev[:200]}"
        for choice in chunk.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    if not text or finish is None:
        return f"stream cut short ({len(events)} events, finish={finish}): {raw[-200:]!r}"
    return ""
