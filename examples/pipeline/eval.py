"""A small evaluation against a model served by xhpc, from inside a Slurm job or on the login
node: the model is served for the length of the `with` block, every question is asked once
(greedy), the answers and a summary are written to OUT, and the model is stopped.

    python examples/pipeline/eval.py --out results/ [--model tiny-llama] [--engine transformers]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import xhpc

QUESTIONS = (
    "What is the capital of France?",
    "Name a prime number greater than ten.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
    "Translate 'good morning' into Italian.",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--model", default="tiny-llama", help="catalog name or model directory")
    parser.add_argument("--name", default=None, help="deployment name (default: the model's)")
    parser.add_argument("--engine", default=None, help="vllm, transformers, ...")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    answers = []
    with xhpc.serve(args.model, name=args.name, engine=args.engine, timeout_s=900) as dep:
        ready_s = time.monotonic() - started
        client = dep.openai(max_retries=0)  # READY means routed: no retry is needed
        for i, question in enumerate(QUESTIONS):
            reply = client.chat.completions.create(
                model=dep.name,
                messages=[{"role": "user", "content": question}],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            answers.append(
                {
                    "id": i,
                    "question": question,
                    "answer": reply.choices[0].message.content,
                    "completion_tokens": reply.usage.completion_tokens if reply.usage else None,
                }
            )
    summary = {
        "deployment": dep.name,
        "model": args.model,
        "questions": len(QUESTIONS),
        "answered": sum(1 for a in answers if a["answer"]),
        "ready_s": round(ready_s, 1),
        "total_s": round(time.monotonic() - started, 1),
    }
    with (args.out / "answers.jsonl").open("w") as fh:
        for row in answers:
            fh.write(json.dumps(row) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0 if summary["answered"] == summary["questions"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
