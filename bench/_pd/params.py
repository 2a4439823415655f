"""The PD benchmark's fixed figures: the vLLM venv, vLLM's toy proxy, the model and vLLM's
cache, the served model name, the KV block size, the contenders (the baseline first), the
decode instance's KV-transfer counter, the parameters of a full and a short (``--short``) run,
the four workloads, and its log line.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._common import ROOT, logger

VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"
TOY_PROXY = ROOT / ".venvs" / "vllm-toy-proxy" / "toy_proxy_server.py"
MODEL_DIR = ROOT / "models" / "tiny-llama"
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


log = logger("pd")
