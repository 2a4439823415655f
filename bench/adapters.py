"""LoRA adapters on one base deployment on the dev Slurm cluster, against the base alone, in one
run (docs/performance.md).

Two deployments of the tiny model on vLLM, up side by side through a broker and a proxy of the
bench's own:

    base alone   ``xhpc serve tiny-llama --engine vllm``: no room for adapters
    3 adapters   the same with ``--engine-config '{"lora": {...}}'`` and three tiny random
                 adapters (scripts/make-tiny-adapter, three seeds) added by ``xhpc adapters
                 add`` while its replica starts

Throughput: ``--clients`` concurrent callers send completions of ``--tokens`` tokens each
(``ignore_eos``) through the proxy for ``--phase-s`` seconds, to one deployment at a time, in
phases that rotate over three mixes (``--phases`` each): the base alone gets the base's name in
every request; the adapters' deployment gets its base and its three adapters in turn (mixed
traffic), and, apart, its base's name only (what room for adapters costs a base's requests).
Figure: completion tokens per second (from each answer's ``usage``), per phase.

Load: the seconds from the replica's READY until it holds each adapter (``xhpc adapters list``:
0 when loaded as its agent registered, before it was READY); once on the first replica, and
again on a replacement after its engine is killed (a successor loads the same way).

Targets (``--json``): the adapters' mixed traffic at >= 0.8x the tokens/s of the base alone
(medians of the phases); every adapter loaded within 2 s of READY, on the first replica and on
the replacement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, tests.conftest

from bench._common import logger, run_on_tiny_model, target_lines  # noqa: E402

log = logger("adapters")
MODEL_DIR = ROOT / "models" / "tiny-llama"
ADAPTERS = 3
LORA = json.dumps({"lora": {"max_loras": ADAPTERS, "max_lora_rank": 8}})
RATIO_FLOOR = 0.8
LOAD_CEILING_S = 2.0
MIXES = ("base alone", "3 adapters", "lora base")
TARGET_THROUGHPUT = f"3 adapters, mixed traffic: >= {RATIO_FLOOR}x the base alone's tokens/s"
TARGET_LOAD = f"each adapter loaded <= {LOAD_CEILING_S:g} s after READY (first and replacement)"
USER_TOML = """
[slurm]
cpus_per_replica = 1

[lifecycle]
backoff_s = 1
lost_grace_s = 20
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the figures and targets here")
    ap.add_argument("--phases", type=int, default=3, help="phases per deployment (default 3)")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent callers (default 4)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer (default 32)")
    args = ap.parse_args(argv)
    if args.phases < 1 or args.phase_s <= 0 or args.clients < 1 or args.tokens < 1:
        ap.error("--phases, --phase-s, --clients and --tokens must be positive")
    return args


# -- traffic ----------------------------------------------------------------------------------
def _complete(port: int, model: str, tokens: int, key: str) -> int:
    """One completion through the proxy: its completion tokens (0: it failed)."""
    body = {"model": model, "prompt": "The cluster", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = json.loads(resp.read())
        return int(data["usage"]["completion_tokens"]) if data["choices"][0]["text"] else 0
    except (OSError, ValueError, KeyError, IndexError, urllib.error.HTTPError):
        return 0


def phase(port: int, models: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """``args.clients`` callers for ``args.phase_s`` seconds, each cycling through ``models``."""
    tokens = [0] * args.clients
    answers = [0] * args.clients
    failed = [0] * args.clients
    stop = time.monotonic() + args.phase_s

    def caller(i: int) -> None:
        k = i
        while time.monotonic() < stop:
            got = _complete(port, models[k % len(models)], args.tokens, "x")
            k += 1
            if got:
                tokens[i] += got
                answers[i] += 1
            else:
                failed[i] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    return {"tokens": sum(tokens), "answers": sum(answers), "failed": sum(failed),
            "seconds": took, "tokens_per_s": sum(tokens) / took}  # fmt: skip


# -- deployments ----------------------------------------------------------------------------------
def _rows(x: Any, name: str) -> list[dict[str, Any]]:
    done = x.run("ps", "--json", check=False)
    found = json.loads(done.stdout) if done.returncode == 0 else []
    return [r for r in found if r["deployment"] == name]


def _views(x: Any) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in json.loads(x.run("adapters", "list", "--json").stdout)}


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def _loads(x: Any, names: Sequence[str], replica: str) -> list[float | None]:
    """Each adapter's seconds from ``replica``'s READY to its load there (None: not loaded)."""
    views = _views(x)
    return [views[n]["load_s"].get(replica) for n in names]


def _held(x: Any, names: Sequence[str], replica: str) -> bool:
    return all(v is not None for v in _loads(x, names, replica))


def _engine_pid(replica_id: str, job_id: str) -> int:
    from tests.cluster.test_chaos import engine_pid

    return engine_pid(replica_id, job_id)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tests.conftest import own_xhpc

    tag = os.getpid()
    plain, lora = f"ad-base-{tag}", f"ad-lora-{tag}"
    names = [f"{lora}-a{i}" for i in range(ADAPTERS)]
    for i in range(ADAPTERS):
        subprocess.run([str(ROOT / "scripts" / "make-tiny-adapter"), str(work / f"a{i}"),
                        str(11 + i)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    data: dict[str, Any] = {"phases": [], "args": {k: v for k, v in vars(args).items()
                                                   if k != "json"}}  # fmt: skip
    with own_xhpc(MODEL_DIR, USER_TOML) as x:
        try:
            serve = ("serve", "tiny-llama", "--engine", "vllm", "--detach")
            x.run(*serve, "--name", plain)
            x.run(*serve, "--name", lora, "--engine-config", LORA)
            for i, name in enumerate(names):
                x.run("adapters", "add", name, "--base", lora, "--path", str(work / f"a{i}"))
            log("both deployments submitted, adapters added; waiting for READY")
            ready = {}
            for dep in (plain, lora):
                rows = _wait(lambda d=dep: [r for r in _rows(x, d) if r["state"] == "READY"],
                             600, f"{dep} READY")  # fmt: skip
                ready[dep] = rows[0]
            first = ready[lora]["replica_id"]
            _wait(lambda: _held(x, names, first), 30, "the adapters loaded")
            data["load_first_s"] = _loads(x, names, first)
            log(f"loads on the first replica: {data['load_first_s']} s after READY")
            mixes = {"base alone": [plain], "3 adapters": [lora, *names], "lora base": [lora]}
            for i in range(len(MIXES) * args.phases):  # in turn, the base alone first
                key = MIXES[i % len(MIXES)]
                # warm: every model of the phase answers once (the proxy routes them all)
                for m in mixes[key]:
                    _wait(lambda m=m: _complete(x.proxy_port, m, 1, "x"), 60, f"{m} answering")
                got = phase(x.proxy_port, mixes[key], args)
                got["contender"] = key
                data["phases"].append(got)
                log(f"{key}: {got['tokens_per_s']:.1f} tokens/s ({got['failed']} failed)")
            row = ready[lora]
            os.kill(_engine_pid(row["replica_id"], str(row["job_id"])), signal.SIGKILL)
            log("engine of the adapters' replica killed; waiting for its replacement")

            def replaced() -> list[dict[str, Any]]:
                rows = _rows(x, lora)
                return [r for r in rows if r["state"] == "READY" and r["replica_id"] != first]

            repl = _wait(replaced, 600, "a replacement READY")
            rid = repl[0]["replica_id"]
            _wait(lambda: _held(x, names, rid), 30, "the adapters on the replacement")
            data["load_replacement_s"] = _loads(x, names, rid)
            log(f"loads on the replacement: {data['load_replacement_s']} s after READY")
        finally:
            for dep in (plain, lora):
                x.run("stop", dep, check=False)
    return data


# -- the table ------------------------------------------------------------------------------------
def rates(data: dict[str, Any], key: str) -> list[float]:
    return [p["tokens_per_s"] for p in data.get("phases", []) if p["contender"] == key]


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    base, mixed = rates(data, "base alone"), rates(data, "3 adapters")
    if base and mixed:
        ratio = statistics.median(mixed) / statistics.median(base)
        value = f"{ratio:.2f}x ({statistics.median(mixed):.1f} vs {statistics.median(base):.1f})"
        out.append({"target": TARGET_THROUGHPUT, "value": value, "met": ratio >= RATIO_FLOOR})
    else:
        out.append({"target": TARGET_THROUGHPUT, "value": "not measured", "met": False})
    loads = [*data.get("load_first_s", [None]), *data.get("load_replacement_s", [None])]
    worst = None if any(v is None for v in loads) else max(loads)
    out.append({"target": TARGET_LOAD, "value": "not measured" if worst is None
                else f"worst {worst:.3f} s", "met": worst is not None
                and worst <= LOAD_CEILING_S})  # fmt: skip
    return out


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def table(data: dict[str, Any]) -> str:
    lines = [
        "| figure | base alone | 3 adapters (mixed) | ratio | its base's name only | ratio |",
        "|---|---|---|---|---|---|",
    ]
    base, mixed, own = (
        rates(data, "base alone"),
        rates(data, "3 adapters"),
        rates(data, "lora base"),
    )

    def ratio(of: list[float]) -> str:
        return f"{statistics.median(of) / statistics.median(base):.2f}x" if base and of else "-"

    lines.append(f"| tokens/s: median [min, max] | {_spread(base)} | {_spread(mixed)} | "
                 f"{ratio(mixed)} | {_spread(own)} | {ratio(own)} |")  # fmt: skip
    failed = {k: sum(p["failed"] for p in data.get("phases", []) if p["contender"] == k)
              for k in MIXES}  # fmt: skip
    lines.append(f"| failed requests | {failed['base alone']} | {failed['3 adapters']} | | "
                 f"{failed['lora base']} | |")  # fmt: skip
    for part, key in (("first replica", "load_first_s"), ("replacement", "load_replacement_s")):
        got = data.get(key)
        shown = ", ".join("-" if v is None else f"{v:.3f}" for v in got) if got else "-"
        lines.append(f"| adapter load after READY, {part} (s) | | {shown} | | | |")
    lines.append("")
    lines += target_lines(data["targets"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_on_tiny_model(
        "adapters", args.json, lambda work: run(args, work), targets, table, MODEL_DIR
    )


if __name__ == "__main__":
    sys.exit(main())
