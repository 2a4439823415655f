"""In-allocation serving from a pipeline job: the same questions to a model served with
``xhpc.local`` in this process and to one served by ``xhpc run-server`` beside it (its ready
file named by --server), greedy; the answers, the GPUs each got and whether they agree are
written to OUT. No broker takes part: both run on this job's GPUs.

    python examples/pipeline/local_eval.py --out results/ --server READY_FILE [--engine E]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import openai

import xhpc

QUESTIONS = (
    "What is the capital of France?",
    "Name a prime number greater than ten.",
    "How many legs does a spider have?",
)


def ready_server(path: Path, deadline_s: float) -> dict[str, object]:
    """The ready file of `xhpc run-server`, once it is written."""
    end = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"xhpc run-server wrote no {path} in {deadline_s:.0f} s")
        time.sleep(0.2)
    facts: dict[str, object] = json.loads(path.read_text())
    return facts


def ask(client: openai.OpenAI, model: str, max_tokens: int) -> list[str]:
    answers = []
    for question in QUESTIONS:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
        )
        answers.append(reply.choices[0].message.content or "")
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--server", type=Path, required=True, help="run-server's ready file")
    parser.add_argument("--model", default="tiny-llama", help="catalog name or model directory")
    parser.add_argument("--engine", default=None, help="vllm, transformers, ...")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    with xhpc.local(args.model, gpus=1, engine=args.engine, timeout_s=900) as mine:
        here = ask(mine.openai(max_retries=0), mine.model, args.max_tokens)
        facts = ready_server(args.server, 900)
        key = Path(str(facts["key_file"])).read_text().strip()
        beside = openai.OpenAI(base_url=str(facts["base_url"]), api_key=key, max_retries=0)
        there = ask(beside, str(facts["model"]), args.max_tokens)
        summary = {
            "questions": len(QUESTIONS),
            "local_gpus": list(mine.gpus),
            "server_gpus": facts["gpus"],
            "agree": here == there,
            "answers": here,
        }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0 if summary["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
