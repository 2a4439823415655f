"""A submitit pipeline that reaches models through xhpc, two ways:

- ``local``: one submitit job that serves the model on its own GPU with ``xhpc.local`` (no
  broker, no proxy) and asks it the questions;
- ``array``: a submitit job array, one task per question, each calling a lab deployment that is
  already served (``xhpc serve MODEL --name NAME``) with ``xhpc.connect``.

Run it from the login node with xhpc's config in the environment (the state directory on a
filesystem the compute nodes see, the proxy on an address they reach: docs/pipelines.md):

    python examples/pipeline/submitit_eval.py --folder runs/ local tiny-llama
    python examples/pipeline/submitit_eval.py --folder runs/ array NAME

It waits for the jobs and prints one JSON object: the answers, in question order, and the
Slurm job ids. Slurm options go through submitit's own parameters (--partition, --time-min).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import submitit

import xhpc

QUESTIONS = (
    "What is the capital of France?",
    "Name a prime number greater than ten.",
    "How many legs does a spider have?",
)


def _answer(client: Any, model: str, question: str, max_tokens: int) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return str(reply.choices[0].message.content or "")


def serve_here_and_ask(model: str, engine: str | None, max_tokens: int) -> dict[str, Any]:
    """In the submitit job: serve ``model`` on one of the job's GPUs and ask every question."""
    with xhpc.local(model, gpus=1, engine=engine) as srv:
        client = srv.openai()
        answers = [_answer(client, srv.model, q, max_tokens) for q in QUESTIONS]
        return {"answers": answers, "gpus": list(srv.gpus)}


def ask_deployment(name: str, question: str, max_tokens: int) -> str:
    """In one task of the job array: ask the lab's deployment ``name`` one question."""
    with xhpc.connect(name) as dep:
        return _answer(dep.openai(), dep.name, question, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="submitit's folder for jobs and results")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time-min", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engine", default=None, help="local: the engine (the catalog's)")
    parser.add_argument("mode", choices=("local", "array"))
    parser.add_argument("model", help="local: the model to serve; array: the deployment")
    args = parser.parse_args()

    executor = submitit.AutoExecutor(folder=args.folder, cluster="slurm")
    params: dict[str, Any] = {"timeout_min": args.time_min, "slurm_cpus_per_task": 1}
    if args.partition:
        params["slurm_partition"] = args.partition
    if args.mode == "local":
        params["slurm_gres"] = "gpu:1"  # the engine runs on this job's own GPU
        executor.update_parameters(name="xhpc-submitit-local", **params)
        job = executor.submit(serve_here_and_ask, args.model, args.engine, args.max_tokens)
        result = job.result()
        print(json.dumps({**result, "jobs": [job.job_id]}))
        return
    executor.update_parameters(name="xhpc-submitit-array", **params)  # no GPU: the lab's model
    jobs = executor.map_array(
        ask_deployment,
        [args.model] * len(QUESTIONS),
        list(QUESTIONS),
        [args.max_tokens] * len(QUESTIONS),
    )
    answers = [j.result() for j in jobs]
    print(json.dumps({"answers": answers, "jobs": [j.job_id for j in jobs]}))


if __name__ == "__main__":
    main()
