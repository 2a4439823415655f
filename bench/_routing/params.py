"""The routing benchmark's fixed figures: the vLLM venv and cache, the model (made by
bench/make_routing_model.py), the policies compared and their labels, the KV block size, the
target (docs/performance.md), the parameters of a full and a short (``--short``) run, and its
log line.
"""

from __future__ import annotations

from dataclasses import dataclass

from make_routing_model import DEFAULT_OUT

from bench._common import ROOT, logger
from xhpc.settings import RoutingPolicyName

MODEL_DIR = DEFAULT_OUT  # models/routing-llama
VLLM_VENV = ROOT / ".venvs" / "vllm"
VLLM_PY = VLLM_VENV / "bin" / "python"
VLLM_CACHE = ROOT / "models" / ".routing-llama-vllm-cache"  # next to the model (git-ignored)
HOST = "127.0.0.1"
MODEL = "rt"  # the name clients use
BLOCK = 128  # vLLM CPU's KV block size (checked against the engine's cache_config_info)
POLICIES: tuple[RoutingPolicyName, ...] = ("affinity", "round-robin")
LABELS = {"affinity": "affinity", "round-robin": "round robin"}
TARGET_P90_RATIO = 0.5  # docs/performance.md: affinity TTFT p90 <= 0.5x round robin


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


log = logger("routing")
