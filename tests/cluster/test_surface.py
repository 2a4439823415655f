"""The rest of the OpenAI-style surface, transparent: on the dev cluster, real vLLM on CPU serves
the tiny model (generate) and a tiny random cross-encoder (``--runner pooling``), and every
answer of responses (whole and streamed), tokenize, detokenize, rerank and score through the
gateway is the engine's own answer to the same request sent to it directly (but for the ids and
times it makes anew for each request, and the model's public name for its path). A path an
engine lacks is an OpenAI-shaped 404 that names the engine."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.cluster.test_chaos import ready
from tests.conftest import Xhpc, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

# New for every request (ids, times), or counting the engine's deltas (how many tokens each
# carries depends on timing).
FRESH = frozenset({"id", "created", "created_at", "item_id", "response_id", "sequence_number"})


def _post(
    url: str, path: str, body: dict[str, Any], secret: str | None = None
) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _same(value: Any) -> Any:
    """``value`` without what an engine makes anew for every request (ids, times)."""
    if isinstance(value, dict):
        return {k: _same(v) for k, v in value.items() if k not in FRESH}
    if isinstance(value, list):
        return [_same(v) for v in value]
    return value


def _events(raw: bytes) -> list[tuple[str, Any]]:
    """A typed event stream's (event, data) pairs."""
    out = []
    for block in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event", ""), _same(json.loads(fields["data"]))))
    return out


class Engine:
    """A deployment's one replica, called directly with its secret and its engine's name."""

    def __init__(self, x: Xhpc, name: str) -> None:
        (row,) = ready(x, name)
        self.url = f"http://{row['host']}:{row['port']}"
        rdir = x.state_dir / "replicas" / row["replica_id"]
        self.secret = (rdir / "engine_secret").read_text().strip()  # the test is its owner
        self.served = json.loads((rdir / "spec.json").read_text())["served_model"]

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        return _post(self.url, path, {**body, "model": self.served}, self.secret)


def _both(x: Xhpc, engine: Engine, name: str, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The gateway's answer and the engine's own, each a 200, as JSON without fresh ids."""
    status, through = _post(x.proxy_url, path, {**body, "model": name})
    assert status == 200, (path, through[:500])
    status, direct = engine.post(path, body)
    assert status == 200, (path, direct[:500])
    assert engine.served.encode() not in through or engine.served == name
    return _same(json.loads(through)), _same(json.loads(direct))


def test_responses_tokenize_rerank_and_score_are_the_engines_own(
    xhpc: Xhpc, unique_name: str, tiny_reranker: Path
) -> None:
    x = xhpc
    gen, ranker = f"{unique_name}-g", f"{unique_name}-r"
    x.run("serve", "tiny-llama", "--name", gen, "--engine", "vllm", "--detach", "--timeout", "300")
    x.run("serve", "tiny-reranker", "--name", ranker, "--timeout", "300")  # pooling: its entry
    wait_for(lambda: len(ready(x, gen)) == 1, 300, "the generate deployment READY")

    def routed() -> bool:
        return all(
            _post(x.proxy_url, "/tokenize", {"model": m, "prompt": "x"})[0] == 200
            for m in (gen, ranker)
        )

    wait_for(routed, 30, "the gateway to route both deployments")
    g, r = Engine(x, gen), Engine(x, ranker)

    # tokenize and detokenize, on both kinds of model
    for engine, name in ((g, gen), (r, ranker)):
        through, direct = _both(x, engine, name, "/tokenize", {"prompt": "hello cluster"})
        assert through == direct and direct["count"] > 0
        tokens = direct["tokens"]
        through, direct = _both(x, engine, name, "/detokenize", {"tokens": tokens})
        assert through == direct and "cluster" in direct["prompt"]
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    through, direct = _both(x, g, gen, "/tokenize", chat)
    assert through == direct

    # responses: whole, and streamed (typed events, no [DONE])
    ask = {"input": "Tell me about the cluster.", "max_output_tokens": 8, "temperature": 0}
    through, direct = _both(x, g, gen, "/v1/responses", ask)
    assert through == {**direct, "model": gen}
    assert direct["usage"]["output_tokens"] == 8
    status, raw = _post(x.proxy_url, "/v1/responses", {**ask, "model": gen, "stream": True})
    assert status == 200
    status, own = g.post("/v1/responses", {**ask, "stream": True})
    assert status == 200
    assert b"[DONE]" not in raw
    ours = _events(raw)
    theirs = [(e, json.loads(json.dumps(d).replace(g.served, gen))) for e, d in _events(own)]
    # The engine may put several tokens in one delta (as its output comes): the deltas' text,
    # and every other event, are its own.
    delta = "response.output_text.delta"
    assert [p for p in ours if p[0] != delta] == [p for p in theirs if p[0] != delta]
    text = ["".join(d["delta"] for e, d in events if e == delta) for events in (ours, theirs)]
    assert text[0] == text[1] and text[0]
    assert ours[-1][0] == "response.completed"
    assert ours[-1][1]["response"]["usage"]["output_tokens"] == 8

    # rerank (three spellings) and score (two)
    docs = {"query": "a cat", "documents": ["a kitten rests", "stock prices fell", "cats sleep"]}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        through, direct = _both(x, r, ranker, path, docs)
        assert through == {**direct, "model": ranker}
        assert sorted(d["index"] for d in direct["results"]) == [0, 1, 2]
    pair = {"text_1": "a cat", "text_2": ["a kitten rests", "stock prices fell"]}
    for path in ("/v1/score", "/score"):
        through, direct = _both(x, r, ranker, path, pair)
        assert through == {**direct, "model": ranker}
        assert len(direct["data"]) == 2

    # a path the engine lacks: an OpenAI 404 naming the engine
    for name, path, body in ((gen, "/v1/rerank", docs), (ranker, "/v1/responses", ask)):
        status, raw = _post(x.proxy_url, path, {**body, "model": name})
        assert status == 404, (path, raw)
        error = json.loads(raw)["error"]
        assert error["code"] == "endpoint_not_served"
        assert (
            error["message"]
            == f"model {name!r} is served by vllm, which does not serve POST {path}"
        )
    x.run("stop", gen)
    x.run("stop", ranker)
    wait_for(lambda: not x.my_jobs(), 120, "no job left")
