"""The gateway benchmark's fixed figures: the contenders (keys and labels), the model names and
upstream key every contender is configured with, the targets (docs/performance.md), the
parameters of a full and a short (``--short``) run, and its log line.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._common import ROOT, logger

LITELLM_VENV = ROOT / ".venvs" / "litellm"
HOST = "127.0.0.1"
MODEL = "bench"  # the name clients use; every contender maps it to the backend
SERVED_MODEL = "bench-model"
UPSTREAM_KEY = "sk-bench-upstream"

# targets (docs/performance.md)
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


log = logger("proxy")
