"""Batch throughput on the dev cluster: one input file answered three ways with the vLLM engine
and the tiny model, each in a 1-GPU, 1-CPU allocation (docs/performance.md).

    vllm run-batch  an sbatch job running ``python -m vllm.entrypoints.openai.run_batch`` on the
                    file, with the engine arguments and environment xhpc's agent gives vLLM
    xhpc batch      ``xhpc batch submit FILE --shards 1 --gpus 1 --engine vllm``: a one-task
                    array whose task serves with ``xhpc run-server`` and sends the lines
    online          ``xhpc serve`` (returns READY and routed), then the same requests through
                    the proxy with the same number in flight, then ``xhpc stop``

Measured: seconds from the submitting command to the last answer on disk (run-batch: the job
left squeue; xhpc batch: the batch completed; online: the last answer came back), the engine's
start included in each; completion tokens summed from the answers' ``usage``; tokens/s. Then the
work a kill makes a batch redo: a second xhpc batch whose task is killed with SIGKILL after it
answered a few lines, requeued by the broker: requests sent (the shard's tally) less lines.

Targets (``--json``): xhpc batch >= 0.9x vllm run-batch in tokens/s, and a kill redoes at most
the requests that were in flight (``--kill-concurrency``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    ROOT,
    TINY_MODEL,
    Procs,
    Summary,
    clean_env,
    emit,
    ensure_tiny_model,
    exit_on_sigterm,
    free_port,
    logger,
    wait,
)
from bench._launch.cluster import job_row, slurm_env

log = logger("batch")
SITE = ROOT / "site-configs" / "dev-cluster.toml"
VLLM_PY = ROOT / ".venvs" / "vllm" / "bin" / "python"
VLLM_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--kv-cache-memory-bytes",
    "67108864",
    "--dtype",
    "float32",
]  # site-configs/dev-cluster.toml
XHPC = [sys.executable, "-m", "xhpc"]


def write_input(path: Path, count: int, max_tokens: int) -> list[dict[str, Any]]:
    requests = []
    for i in range(count):
        body = {
            "model": "tiny-llama",
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {i}: count to {i % 9}."}],
        }
        requests.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return requests


def tokens_of(lines: list[str]) -> tuple[int, int]:
    """(answered lines, completion tokens) of an output file's lines."""
    answered = tokens = 0
    for line in lines:
        out = json.loads(line)
        body = (out.get("response") or {}).get("body") or {}
        if (out.get("response") or {}).get("status_code") == 200:
            answered += 1
            tokens += int((body.get("usage") or {}).get("completion_tokens") or 0)
    return answered, tokens


class Run:
    """The bench's own broker and proxy on the dev cluster, and the xhpc commands against them."""

    def __init__(self, tmp: Path, procs: Procs) -> None:
        self.tmp, self.procs = tmp, procs
        self.state = tmp / "state"
        self.port = free_port()
        self.env = clean_env(
            ("XHPC_",),
            XHPC_SITE_CONFIG=str(SITE),
            XHPC_STATE_DIR=str(self.state),
            XHPC_PROXY_PORT=str(self.port),
            XHPC_MODELS_DIR=str(TINY_MODEL.parent),
        )
        self.env = slurm_env(self.env)

    def start(self) -> None:
        self.state.mkdir()
        self.procs.start("broker", [*XHPC, "broker"], self.env)
        wait(lambda: (self.state / "broker.sock").exists(), 30, "the broker")
        self.procs.start("proxy", [*XHPC, "proxy"], self.env)

    def xhpc(self, *args: str) -> str:
        done = subprocess.run(
            [*XHPC, *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        if done.returncode != 0:
            raise SystemExit(f"bench/batch: xhpc {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def status(self, batch_id: str) -> dict[str, Any]:
        """The batch as the broker has it, asked from this process (a CLI process per poll
        would take CPU from the engine being measured)."""
        from xhpc.client.control import Client

        view: dict[str, Any] = (
            Client.of_state_dir(self.state).batch(batch_id).model_dump(mode="json")
        )
        return view

    def submit(self, infile: Path, concurrency: int) -> dict[str, Any]:
        """``xhpc batch submit``: one shard, one GPU, the vLLM engine."""
        argv = [
            "batch",
            "submit",
            str(infile),
            "--model",
            "tiny-llama",
            "--engine",
            "vllm",
            "--shards",
            "1",
            "--gpus",
            "1",
            "--concurrency",
            str(concurrency),
            "--json",
        ]
        view: dict[str, Any] = json.loads(self.xhpc(*argv))
        return view

    def ended(self, batch_id: str, what: str, step_s: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            view = self.status(batch_id)
            return view if view["status"] not in ("in_progress", "finalizing") else None

        view: dict[str, Any] = wait(done, 900, what, step_s)
        return view


def run_batch_job(tmp: Path, infile: Path) -> tuple[float, list[str]]:
    """vllm run-batch in its own job, the engine as xhpc's agent starts it."""
    out = tmp / "run-batch.out.jsonl"
    env = " ".join(
        [
            "OMP_NUM_THREADS=1",
            "MKL_NUM_THREADS=1",
            "HF_HUB_OFFLINE=1",
            "TRANSFORMERS_OFFLINE=1",
            "VLLM_NO_USAGE_STATS=1",
            "DO_NOT_TRACK=1",
            "VLLM_ENABLE_V1_MULTIPROCESSING=0",
            f"VLLM_CACHE_ROOT={tmp}/vllm-cache",
        ]
    )
    cmd = (
        f"cd {tmp} && env {env} {VLLM_PY} -m vllm.entrypoints.openai.run_batch "
        f"-i {infile} -o {out} --model {TINY_MODEL} --served-model-name tiny-llama "
        + " ".join(VLLM_ARGS)
    )
    t0 = time.monotonic()
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--job-name=bench-run-batch",
            "--gres=gpu:1",
            "--cpus-per-task=1",
            "--time=30:00",
            f"--output={tmp}/run-batch.slurm.out",
            "--wrap",
            cmd,
        ],
        env=slurm_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait(lambda: job_row(job) is None, 900, "the run-batch job", 0.1)
    seconds = time.monotonic() - t0
    if not out.exists():
        raise SystemExit(f"bench/batch: run-batch wrote nothing; see {tmp}/run-batch.slurm.out")
    return seconds, out.read_text().splitlines()


def xhpc_batch(run: Run, infile: Path, concurrency: int) -> tuple[float, list[str]]:
    t0 = time.monotonic()
    view = run.submit(infile, concurrency)
    done = run.ended(view["id"], "the xhpc batch", 0.05)
    seconds = time.monotonic() - t0
    if done["status"] != "completed":
        raise SystemExit(f"bench/batch: the xhpc batch ended {done['status']}: {done['errors']}")
    return seconds, run.xhpc("batch", "results", view["id"]).splitlines()


def online(run: Run, requests: list[dict[str, Any]], concurrency: int) -> tuple[float, list[str]]:
    t0 = time.monotonic()
    run.xhpc("serve", "tiny-llama", "--engine", "vllm", "--name", "bench-batch-online")
    url = f"http://127.0.0.1:{run.port}/v1/chat/completions"

    def send(req: dict[str, Any]) -> str:
        body = {**req["body"], "model": "bench-batch-online"}
        http = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(http, timeout=600) as resp:
            answer = json.loads(resp.read())
            return json.dumps(
                {
                    "custom_id": req["custom_id"],
                    "response": {"status_code": resp.status, "body": answer},
                }
            )

    with ThreadPoolExecutor(concurrency) as pool:
        lines = list(pool.map(send, requests))
    seconds = time.monotonic() - t0
    run.xhpc("stop", "bench-batch-online")
    return seconds, lines


def redone_after_kill(run: Run, infile: Path, concurrency: int) -> tuple[int, int]:
    """(requests sent, lines) of a batch whose task was killed once, then requeued."""
    view = run.submit(infile, concurrency)
    shards = run.state / "batches" / view["id"] / "shards"

    def answered() -> int:
        path = shards / "0.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    wait(lambda: answered() >= 3, 900, "the batch to answer three lines", 0.05)
    subprocess.run(["scancel", "--signal=KILL", f"{view['job_id']}_0"], env=slurm_env(), check=True)
    done = run.ended(view["id"], "the killed batch to complete", 0.2)
    if done["status"] != "completed" or done["requeues"] != {"0": 1}:
        raise SystemExit(f"bench/batch: the killed batch: {done}")
    return (shards / "0.sent").stat().st_size, done["request_counts"]["total"]


def summarize(
    figures: dict[str, tuple[float, int, int]], lines: int, redo: tuple[int, int], concurrency: int
) -> Summary:
    base_rate = figures["vllm run-batch"][2] / figures["vllm run-batch"][0]
    rows = [
        "| contender | seconds | answered | completion tokens | tokens/s | vs run-batch |",
        "|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {"lines": lines, "concurrency": concurrency, "contenders": {}}
    for name, (seconds, answered, tokens) in figures.items():
        rate = tokens / seconds
        rows.append(
            f"| {name} | {seconds:.1f} | {answered}/{lines} | {tokens} | {rate:.1f} | "
            f"{rate / base_rate:.2f}x |"
        )
        data["contenders"][name] = {
            "seconds": seconds,
            "answered": answered,
            "tokens": tokens,
            "tokens_per_s": rate,
        }
    ratio = figures["xhpc batch"][2] / figures["xhpc batch"][0] / base_rate
    sent, total = redo
    rows.append(
        f"\nkilled once and requeued: {sent} requests sent for {total} lines "
        f"({sent - total} redone; {concurrency} in flight at most)"
    )
    data["redone"] = sent - total
    data["targets"] = [
        {
            "target": "xhpc batch tokens/s >= 0.9x vllm run-batch",
            "value": f"{ratio:.2f}x",
            "met": ratio >= 0.9,
        },
        {
            "target": f"a kill redoes <= {concurrency} requests (those in flight)",
            "value": str(sent - total),
            "met": 0 <= sent - total <= concurrency,
        },
    ]
    return Summary("\n".join(rows), data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight for xhpc batch and online (default: all of them, as run-batch "
        "hands every request to its engine at once)",
    )
    parser.add_argument(
        "--kill-concurrency",
        type=int,
        default=4,
        help="requests in flight for the batch that is killed",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run's files")
    args = parser.parse_args()
    concurrency = args.concurrency or args.requests
    exit_on_sigterm()
    t_start = time.monotonic()
    ensure_tiny_model(log)
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-", dir="/tmp"))
    procs = Procs(tmp, reap_groups=True)
    try:
        infile = tmp / "in.jsonl"
        requests = write_input(infile, args.requests, args.max_tokens)
        run = Run(tmp, procs)
        run.start()
        figures = {}
        log("vllm run-batch ...")
        secs, out = run_batch_job(tmp, infile)
        figures["vllm run-batch"] = (secs, *tokens_of(out))
        log("xhpc batch ...")
        secs, out = xhpc_batch(run, infile, concurrency)
        figures["xhpc batch"] = (secs, *tokens_of(out))
        log("online through the proxy ...")
        secs, out = online(run, requests, concurrency)
        figures["online (xhpc serve + proxy)"] = (secs, *tokens_of(out))
        log("a batch killed once ...")
        redo = redone_after_kill(run, infile, args.kill_concurrency)
        emit(summarize(figures, args.requests, redo, args.kill_concurrency), t_start, args.json)
    finally:
        procs.tear_down(args.keep, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
