"""xhpc's own share of submit -> READY, against a bare sbatch of the same engine
(docs/performance.md).

Needs the dev cluster (`scripts/dev-cluster up`), the tiny model and the transformers engine venv.
Interleaves, round by round: A = a bare sbatch job that starts `transformers serve` and is polled
until a chat request answers; B = `xhpc serve` of the same model and engine, followed through the
broker until READY. Prints one table: medians (min-max) of each phase and B - A.

    .venv/bin/python bench/submit_to_ready.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._launch.cluster import chat_ok, job_row, node_address, slurm_env  # noqa: E402
from xhpc.client.http import BrokerTransport  # noqa: E402

SITE = ROOT / "site-configs" / "dev-cluster.toml"
SLURM_ENV = slurm_env()
MODEL = ROOT / "models" / "tiny-llama"
TF_BIN = ROOT / ".venvs" / "transformers" / "bin"
POLL_S = 0.05


def wait(pred, timeout_s: float = 300.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError("benchmark step timed out")


def bare_round(work: Path, n: int) -> dict[str, float]:
    """Phases of a bare sbatch: submit -> RUNNING -> first chat answered."""
    port_file = work / f"bare-{n}.port"
    script = work / f"bare-{n}.sbatch"
    engine = shlex.join([str(TF_BIN / "transformers"), "serve", str(MODEL), "--host", "0.0.0.0"])
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=bench-bare\n#SBATCH --gres=gpu:1\n"
        f"#SBATCH --output={work}/bare-{n}.out\n"
        "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1\n"
        'PORT=$(python3 -c \'import socket; s=socket.socket(); s.bind(("",0)); '
        "print(s.getsockname()[1])')\n"
        f"echo $PORT > {shlex.quote(str(port_file))}\n"
        f"exec {engine} --port $PORT\n"
    )
    t0 = time.monotonic()
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env=SLURM_ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    t_submit = time.monotonic()
    job = wait(lambda: (j := job_row(job_id)) and j.state == "RUNNING" and j)
    t_running = time.monotonic()
    host = node_address(job.node)
    port = int(wait(lambda: port_file.exists() and port_file.read_text().strip()))
    wait(lambda: chat_ok(host, port, str(MODEL), timeout_s=5))
    t_ready = time.monotonic()
    subprocess.run(["scancel", job_id], env=SLURM_ENV, check=True)
    wait(lambda: (j := job_row(job_id)) is None or j.state != "RUNNING")
    return {
        "submit": t_submit - t0,
        "queue": t_running - t_submit,
        "start": t_ready - t_running,
        "total": t_ready - t0,
    }


def xhpc_round(broker: BrokerTransport, n: int) -> dict[str, float]:
    """Phases of `xhpc serve` seen through the broker: submitted -> STARTING -> READY."""
    name = f"bench-{os.getpid()}-{n}"
    body = json.dumps({"model": "tiny-llama", "name": name, "gpus": 1, "engine": "transformers"})
    t0 = time.monotonic()
    broker.post("/v1/serve", body)
    t_submit = time.monotonic()

    def state() -> str:
        return str(broker.get(f"/v1/deployments/{name}")["replicas"][0]["state"])

    wait(lambda: state() in ("STARTING", "READY", "FAILED"))
    t_running = time.monotonic()
    final = wait(lambda: (s := state()) in ("READY", "FAILED") and s)
    t_ready = time.monotonic()
    if final != "READY":
        raise RuntimeError(f"{name} ended {final}")
    broker.post("/v1/stop", json.dumps({"target": name}))
    wait(lambda: state() == "STOPPED")
    return {
        "submit": t_submit - t0,
        "queue": t_running - t_submit,
        "start": t_ready - t_running,
        "total": t_ready - t0,
    }


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="xb-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(
        XHPC_SITE_CONFIG=str(SITE),
        XHPC_STATE_DIR=str(work / "state"),
        XHPC_MODELS_DIR=str(MODEL.parent),
    )
    (work / "state").mkdir()
    log = (work / "broker.log").open("w")
    proc = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "xhpc"), "broker"], env=env, stdout=log, stderr=log
    )
    broker = BrokerTransport(work / "state" / "broker.sock")
    try:
        wait(broker.alive, 20)
        bare: list[dict[str, float]] = []
        ours: list[dict[str, float]] = []
        for n in range(args.rounds):
            bare.append(bare_round(work, n))
            ours.append(xhpc_round(broker, n))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    print(f"submit -> READY, {args.rounds} interleaved rounds, seconds: median (min-max)")
    print(f"{'phase':<8} {'bare sbatch':>20} {'xhpc serve':>20} {'xhpc - bare':>20}")
    for phase in ("submit", "queue", "start", "total"):
        a = [r[phase] for r in bare]
        b = [r[phase] for r in ours]
        d = [y - x for x, y in zip(a, b, strict=True)]
        print(f"{phase:<8} {fmt(a):>20} {fmt(b):>20} {fmt(d):>20}")
    print("target: xhpc - bare total <= 1.0 s (docs/performance.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
