"""The workload, seeded: sessions with a long document of their own and short user turns, each
turn's prompt extending the previous one, the turns interleaved across sessions; the prompts as
the model's chat template renders them, counted by the model's own tokenizer, in KV blocks.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
from dataclasses import dataclass

from make_routing_model import words

from .params import BLOCK, MODEL_DIR, VLLM_PY, Params

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
