"""Hostile tenants: a third key's chat p99 and the broker's health p99, quiet and under load.

While one API key uploads a 64 MiB JSONL file through the gateway's Files API (``POST
/v1/files``, multipart, purpose batch) again and again, and another floods files and batches
(small uploads, ``POST /v1/batches`` each cancelled at once, get, list, deletes:
bench/_hostile/tenants.py), a third key's chat completions through the gateway and the broker's
``GET /v1/health`` over its control socket are sent at a fixed pace and timed
(bench/_hostile/measure.py). Quiet is the same chat and health traffic with no hostile tenant,
in the same run, interleaved: quiet, hostile, quiet, hostile ... (``--rounds`` pairs of
``--round-s`` seconds each).

It runs a broker and a gateway of its own (own state directory and port, ``[proxy] auth =
"keys"``) on the dev cluster (brought up if it is not running, and down again at the end only
then): the chat's deployment is the ``command`` engine running the standard-library echo engine
(tests/data/engines/echo_engine.py) on a model directory that holds only ``config.json`` (the
catalog model ``bench-echo``), so the engine's own time is small and the same in both
conditions. The keys belong to three users: the third key is root's, with no limit; the
uploading key xhpc-member's and the flooding key xhpc-member2's (users the dev cluster makes),
with no limit unless ``--hostile-rpm`` gives one: a 429 for a hostile key is counted apart, and
is no error of the third key.

Printed: one row per condition (median of the rounds' p50 and p99 with [min, max]; each hostile
round's p99 over the quiet round's before it, median [min, max]; requests done; errors), what
the hostile tenants did and got per call, and the targets: chat p99 and health p99 under hostile
load <= 2x quiet (median of the round ratios), and no 5xx (nor a request with no answer) for the
third key and the broker in any round. Exit 0 once printed, targets met or not.

    .venv/bin/python bench/hostile.py [--quick] [--rounds N] [--round-s S] [--json FILE] [--keep]

``--quick``: 2 pairs of 6 s rounds (under a minute). The default: 5 pairs of 20 s (about 4
minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    Procs,
    clean_env,
    emit,
    exit_on_sigterm,
    free_port,
    logger,
    wait,
)
from bench._hostile.measure import Meter  # noqa: E402
from bench._hostile.table import summarize  # noqa: E402
from bench._hostile.tenants import write_big  # noqa: E402
from bench._launch.cluster import scancel, slurm_env  # noqa: E402

log = logger("hostile")
SITE = ROOT / "site-configs" / "dev-cluster.toml"
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"
ECHO = ROOT / "tests" / "data" / "engines" / "echo_engine.py"
XHPC = [sys.executable, "-m", "xhpc"]
MODEL = "bench-echo"  # the catalog model of the bench's user config
DEPLOYMENT = "bench-hostile"
USERS = {"chat": "root", "upload": "xhpc-member", "flood": "xhpc-member2"}
BIG_BYTES = 64 << 20
BIG_LINE_BYTES = 1024  # 65,536 lines: under the gateway's default of 100,000 a file


def user_config(models: Path) -> str:
    return f"""
[engines.command]
command = ["{sys.executable}", "{ECHO}", "--port", "{{port}}", "--served-model", "{{served_model}}"]
startup_timeout_s = 60

[proxy]
auth = "keys"

[models.{MODEL}]
path = "{models / MODEL}"
engine = "command"
"""


class Run:
    """The bench's own broker and gateway on the dev cluster, its deployment and its keys."""

    def __init__(self, tmp: Path, procs: Procs) -> None:
        self.tmp, self.procs = tmp, procs
        self.state = tmp / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        models = tmp / "models"
        (models / MODEL).mkdir(parents=True)
        (models / MODEL / "config.json").write_text("{}\n")  # the echo engine reads no weights
        (tmp / "user.toml").write_text(user_config(models))
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = slurm_env(
            clean_env(
                ("XHPC_",),
                PYTHONPATH=path,  # this checkout's xhpc, for every process the bench starts
                XHPC_SITE_CONFIG=str(SITE),
                XHPC_STATE_DIR=str(self.state),
                XHPC_PROXY_PORT=str(self.port),
                XHPC_MODELS_DIR=str(models),
                XHPC_USER_CONFIG=str(tmp / "user.toml"),
            )
        )
        self.keys: dict[str, str] = {}

    def xhpc(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            [*XHPC, *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"bench/hostile: xhpc {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def start(self, hostile_rpm: int | None) -> None:
        self.state.mkdir()
        self.procs.start("broker", [*XHPC, "broker"], self.env)
        wait(lambda: (self.state / "broker.sock").exists(), 30, "the broker")
        self.procs.start("proxy", [*XHPC, "proxy"], self.env)
        self.xhpc("serve", MODEL, "--name", DEPLOYMENT, "--engine", "command", "--timeout", "90")
        for role, user in USERS.items():
            rpm = ["--rpm", str(hostile_rpm)] if hostile_rpm and role != "chat" else []
            made = json.loads(self.xhpc("keys", "create", "--user", user, *rpm, "--json"))
            self.keys[role] = str(made["key"])
        # Every key has reached both gateway workers (grants sync about once a second; each
        # fresh connection may land on either worker): several answers in a row, each.
        chat = json.dumps(
            {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ).encode()
        calls = {"chat": ("/v1/chat/completions", chat), "upload": ("/v1/files", None),
                 "flood": ("/v1/files", None)}  # fmt: skip
        for role, (path, body) in calls.items():
            key = self.keys[role]
            wait(lambda: all(self.answers(path, key, body) for _ in range(8)),  # noqa: B023
                 60, f"the gateway to take the {role} key")  # fmt: skip

    def answers(self, path: str, key: str, body: bytes | None) -> bool:
        req = urllib.request.Request(
            self.url + path, data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False

    def my_jobs(self) -> list[str]:
        """Jobs in squeue whose output goes under this run's state directory."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i|%o"], env=slurm_env(), capture_output=True, text=True,
            timeout=20, check=False,
        ).stdout  # fmt: skip
        return [ln.split("|")[0] for ln in out.splitlines() if str(self.state) in ln]

    def live_batches(self) -> list[str]:
        """The flooding key's batches still in progress (none when the gateway does not say)."""
        req = urllib.request.Request(
            f"{self.url}/v1/batches", headers={"Authorization": f"Bearer {self.keys['flood']}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                listed = json.loads(resp.read())["data"]
        except (OSError, ValueError, KeyError):
            return []
        return [b["id"] for b in listed if b["status"] in ("validating", "in_progress")]

    def clean_up(self) -> None:
        """Cancel whatever batch is still live (through the gateway: a job cancelled behind
        the broker's back would be requeued) and stop the deployment; wait for their jobs to
        leave squeue (cancelling any left after 60 s). Tenants still running (an interrupted
        round) are stopped first: they cancel their own batches."""
        tenants = [name for name in self.procs.procs if name.startswith("tenants-")]
        if tenants:
            self.procs.stop(*tenants)
        if "flood" in self.keys:
            for batch_id in self.live_batches():
                cancel = urllib.request.Request(
                    f"{self.url}/v1/batches/{batch_id}/cancel", data=b"{}",
                    headers={"Authorization": f"Bearer {self.keys['flood']}"},
                )  # fmt: skip
                try:
                    urllib.request.urlopen(cancel, timeout=30).close()
                except OSError as err:
                    log(f"cancelling {batch_id}: {err}")
        if (self.state / "broker.sock").exists():
            try:
                self.xhpc("stop", DEPLOYMENT, timeout_s=60)
            except (SystemExit, subprocess.TimeoutExpired) as err:
                log(f"xhpc stop: {err}")
        try:
            wait(lambda: not self.my_jobs(), 60, "the run's jobs to leave squeue", 0.5)
        except TimeoutError:
            left = self.my_jobs()
            log(f"cancelling {len(left)} job(s) left: {' '.join(left)}")
            scancel(left)
            wait(lambda: not self.my_jobs(), 60, "the cancelled jobs to leave squeue", 0.5)


async def hostile_round(run: Run, args: argparse.Namespace, meter: Meter, n: int) -> dict[str, Any]:
    """The tenants started (a process of their own), one measured round, the tenants stopped:
    the round's figures and theirs."""
    ready, out = run.tmp / f"tenants-{n}.ready", run.tmp / f"tenants-{n}.json"
    spec = run.tmp / f"tenants-{n}.spec.json"
    spec.touch(mode=0o600)
    spec.write_text(json.dumps({
        "url": run.url, "upload_key": run.keys["upload"], "flood_key": run.keys["flood"],
        "big_file": str(run.tmp / "big.jsonl"), "model": MODEL,
        "flood_loops": args.flood_loops, "uploads": args.uploads,
        "ready": str(ready), "out": str(out),
    }))  # fmt: skip
    name = f"tenants-{n}"
    run.procs.start(name, [sys.executable, "-m", "bench._hostile.tenants", str(spec)], run.env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if time.monotonic() > deadline or run.procs.procs[name].poll() is not None:
            raise SystemExit(f"bench/hostile: the tenants did not start:\n"
                             f"{run.procs.log_tail(name)}")  # fmt: skip
        await asyncio.sleep(0.05)
    figures = await meter.round(args.round_s, 1 / args.chat_rate, 1 / args.health_rate)
    await asyncio.to_thread(run.procs.stop, name)
    if not out.exists():
        raise SystemExit(f"bench/hostile: the tenants wrote no counts:\n"
                         f"{run.procs.log_tail(name)}")  # fmt: skip
    tenants = json.loads(out.read_text())
    left = tenants["not_cleaned"]
    if left["batches"] or left["files"]:
        log(f"round {n}: the tenants left {left}")
    return {"kind": "hostile", "round": n, **figures, "tenants": tenants}


async def rounds(run: Run, args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    meter = Meter(run.url, run.keys["chat"], DEPLOYMENT, run.state / "broker.sock")
    async with meter:
        await meter.round(args.warm_s, 1 / args.chat_rate, 1 / args.health_rate)  # not kept
        for n in range(args.rounds):
            log(f"round {n + 1}/{args.rounds}: quiet")
            figures = await meter.round(args.round_s, 1 / args.chat_rate, 1 / args.health_rate)
            out.append({"kind": "quiet", "round": n, **figures})
            log(f"round {n + 1}/{args.rounds}: hostile")
            out.append(await hostile_round(run, args, meter, n))
            await asyncio.sleep(args.settle_s)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 pairs of 6 s rounds")
    parser.add_argument("--rounds", type=int, default=None, help="quiet+hostile pairs (5)")
    parser.add_argument("--round-s", type=float, default=None, help="seconds a round (20)")
    parser.add_argument("--warm-s", type=float, default=3.0, help="unmeasured traffic first")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause after a hostile round")
    parser.add_argument("--chat-rate", type=float, default=20.0, help="chat requests a second")
    parser.add_argument("--health-rate", type=float, default=20.0, help="health calls a second")
    parser.add_argument("--flood-loops", type=int, default=4, help="flooding loops at once")
    parser.add_argument("--uploads", type=int, default=1, help="64 MiB uploads at once")
    parser.add_argument(
        "--hostile-rpm",
        type=int,
        default=None,
        help="requests a minute for the two hostile keys (default: no limit)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run's files and logs")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.round_s is None:
        args.round_s = 6.0 if args.quick else 20.0
    return args


def params(args: argparse.Namespace) -> dict[str, Any]:
    keep = ("rounds", "round_s", "chat_rate", "health_rate", "flood_loops", "uploads",
            "hostile_rpm")  # fmt: skip
    return {k: getattr(args, k) for k in keep} | {"upload_bytes": BIG_BYTES, "users": USERS}


def main() -> int:
    args = parse_args()
    exit_on_sigterm()
    t_start = time.monotonic()
    brought_up = subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True).returncode != 0
    if brought_up:
        log("the dev cluster is not running: bringing it up (and down at the end)")
        subprocess.run([str(DEV_CLUSTER), "up"], check=True, stdout=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="bench-hostile-", dir="/tmp"))
    procs = Procs(tmp, grace_s=45.0)
    run = Run(tmp, procs)
    try:
        lines = write_big(tmp / "big.jsonl", BIG_BYTES, BIG_LINE_BYTES, MODEL)
        log(f"a {BIG_BYTES >> 20} MiB input of {lines} lines; starting a broker and a gateway")
        run.start(args.hostile_rpm)
        measured = asyncio.run(rounds(run, args))
        emit(summarize(measured, params(args)), t_start, args.json)
    finally:
        try:
            run.clean_up()
        finally:
            procs.tear_down(args.keep, log)
            if brought_up:
                subprocess.run([str(DEV_CLUSTER), "down"], check=False, stdout=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
