"""Replicas across nodes on the dev Slurm cluster, interleaved in one run (docs/performance.md).

Three parts, each against a broker and a proxy of the bench's own:

1. **Launch -> first answer** of the tiny model, contenders in an order rotated each round:

       xhpc 2 nodes  ``xhpc serve tiny-llama --engine vllm --nodes 2 --gpus 1 --detach``: one
                     job over two nodes, vLLM's pipeline across them (its own multi-node launch)
       xhpc 1 node   the same with ``--gpus 1`` on one node
       vec-inf 2     ``vec-inf launch`` of the same model with ``num_nodes: 2`` and
                     ``--pipeline-parallel-size 2``: vec-inf's multi-node mode, which starts a
                     Ray cluster in the job and runs vLLM on it

   Measured as bench/launch.py measures (bench/_launch/measure.py: the first HTTP 200 of a
   chat completion, from the launch command's start). vLLM's CPU platform refuses Ray (see
   docs/decisions/0028-multi-node-engines.md), so on this test bed vec-inf's two-node job
   fails; the run records the failure, and its target is then not met ("not measured").

2. **Node loss**: a two-node replica under steady traffic; the node of its rank 1 fails
   (``scripts/dev-cluster node-fail``). Measured: seconds from the failure until the replica is
   out of rotation (not READY in the broker's answer, polled every 0.1 s), and until a whole
   replacement is READY.

3. **Walltime handover**: a two-node deployment with a 6-minute job and a 5-minute handover
   floor under steady traffic through the proxy: failed requests until the successor serves
   and the first replica is retired.

Targets (``--json``): xhpc's two-node launch not slower than vec-inf's (medians); out of
rotation within 5 s of a node loss, and the replacement READY; 0 failed requests across a
handover.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, bench._launch, tests.conftest

from bench._common import run_on_tiny_model, target_lines  # noqa: E402
from bench._launch import engine, vecinf  # noqa: E402
from bench._launch.contenders import (  # noqa: E402
    Contender,
    Launch,
    Nodes,
    Run,
    VecInf,
    XhpcLike,
    XhpcServe,
)
from bench._launch.engine import VllmCommand  # noqa: E402
from bench._launch.measure import cancel_left, measure  # noqa: E402
from bench._launch.params import (  # noqa: E402
    LABELS,
    MODEL,
    MODEL_DIR,
    RESOURCES,
    TIMEOUT_S,
    Resources,
    log,
)

XHPC = Path(sys.executable).parent / "xhpc"
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"
KEYS = ("xhpc-2", "xhpc-1", "vec-inf-2")
LABELS.update({"xhpc-2": "xhpc 2 nodes", "xhpc-1": "xhpc 1 node", "vec-inf-2": "vec-inf 2 nodes"})
OUT_OF_ROTATION_S = 5.0
TARGET_LAUNCH = "xhpc 2-node launch -> first answer not slower than vec-inf's 2-node (medians)"
TARGET_LOSS = f"node loss: out of rotation within {OUT_OF_ROTATION_S:g} s, replacement READY"
TARGET_HANDOVER = "walltime handover of a 2-node deployment: 0 failed requests"
# The bench's broker: quick replacement, and a successor 5 minutes before a job's end.
USER_TOML = """
[lifecycle]
backoff_s = 1
lost_grace_s = 20
handover_floor_s = 300
"""


class XhpcNodes(XhpcServe):
    """`xhpc serve` of a replica over ``nodes`` nodes, one GPU on each."""

    def __init__(self, x: XhpcLike, work: Path, nodes: int) -> None:
        super().__init__(x, str(XHPC), work, RESOURCES, follow=False)
        self.nodes = nodes
        self.key = f"xhpc-{nodes}"

    def argv(self, name: str) -> list[str]:
        return [*super().argv(name), "--nodes", str(self.nodes)]

    def prepare(self, tag: str) -> Launch:
        launch = super().prepare(f"{self.nodes}n-{tag}")
        launch.key = self.key
        return launch


class VecInfNodes(VecInf):
    """`vec-inf launch` of the model over two nodes: ``num_nodes: 2`` and the pipeline across
    them (vec-inf then starts Ray in the job)."""

    key = "vec-inf-2"

    def prepare(self, tag: str) -> Launch:
        launch = super().prepare(tag)
        launch.key = self.key
        path = self.dirs.models_file(launch.served)
        path.write_text(two_node_config(path.read_text()))
        return launch


def two_node_config(text: str) -> str:
    """bench/launch.py's vec-inf model config over two nodes, the pipeline across them."""
    if "num_nodes: 1" not in text or "vllm_args: {" not in text:
        raise RuntimeError("the vec-inf model config has no num_nodes or vllm_args to change")
    text = text.replace("num_nodes: 1", "num_nodes: 2", 1)
    return text.replace("vllm_args: {", 'vllm_args: {"--pipeline-parallel-size": "2", ', 1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=2, help="launch rounds (default 2)")
    ap.add_argument("--json", type=Path, help="also write the figures and targets here")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a launch may take")
    ap.add_argument(
        "--skip", choices=("launch", "loss", "handover"), action="append", default=[],
        help="leave a part out (repeatable)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


# -- parts 2 and 3: a deployment under traffic ---------------------------------------------
class Load:
    """Chat completions through the proxy back to back, each answer checked (a 200 with text)."""

    def __init__(self, port: int, model: str) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.model = model
        self.outcomes: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _one(self) -> tuple[bool, str]:
        import urllib.error
        import urllib.request

        body = json.dumps(
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 4, "ignore_eos": True}
        ).encode()  # fmt: skip
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=180) as resp:
                data = json.loads(resp.read())
            text = data["choices"][0]["message"]["content"]
            return bool(text), "" if text else "empty answer"
        except urllib.error.HTTPError as err:
            return False, f"HTTP {err.code}"
        except (OSError, ValueError, KeyError, IndexError) as err:
            return False, type(err).__name__

    def _loop(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic()
            ok, why = self._one()
            self.outcomes.append((at, ok, why))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(200)

    def ok_since(self, t: float) -> int:
        return sum(1 for at, ok, _ in self.outcomes if ok and at >= t)

    def failed(self) -> list[str]:
        return [why for _, ok, why in self.outcomes if not ok]


def rows(x: XhpcLike, name: str, all_: bool = False) -> list[dict[str, Any]]:
    done = x.run("ps", "--json", *(["--all"] if all_ else []), check=False)
    found = json.loads(done.stdout) if done.returncode == 0 else []
    return [r for r in found if r["deployment"] == name]


def ready(x: XhpcLike, name: str) -> list[dict[str, Any]]:
    return [r for r in rows(x, name) if r["state"] == "READY"]


def until(pred: Any, timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until ``pred()`` holds (None: not within ``timeout_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def job_nodes(job_id: str) -> list[str]:
    from tests.conftest import slurm_env

    env = slurm_env()
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=env,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    names = subprocess.run(["scontrol", "show", "hostnames", out], env=env,
                           capture_output=True, text=True).stdout  # fmt: skip
    return names.split()


def serve(x: XhpcLike, name: str, *extra: str) -> None:
    x.run("serve", MODEL, "--name", name, "--engine", "vllm", "--nodes", "2", "--gpus", "1",
          "--timeout", "600", *extra)  # fmt: skip


def node_loss(x: XhpcLike, name: str) -> dict[str, Any]:
    serve(x, name)
    (first,) = ready(x, name)
    victim = job_nodes(str(first["job_id"]))[1]
    k = victim.removeprefix("n")
    out: dict[str, Any] = {"victim": victim}
    try:
        with Load(x.proxy_port, name) as load:
            until(lambda: load.ok_since(0) >= 2, 120, 0.2)
            subprocess.run([str(DEV_CLUSTER), "node-fail", k], check=True)
            out["out_of_rotation_s"] = until(lambda: not ready(x, name), 60)

            def replaced() -> bool:
                now = ready(x, name)
                return len(now) == 1 and now[0]["replica_id"] != first["replica_id"]

            out["replacement_ready_s"] = until(replaced, 600, 0.5)
            after = time.monotonic()
            until(lambda: load.ok_since(after) >= 2, 120, 0.2)
            out["answers_after"] = load.ok_since(after)
    finally:
        subprocess.run([str(DEV_CLUSTER), "node-up", k], check=True)
        x.run("stop", name, check=False)
    lost = [r for r in rows(x, name, all_=True) if r["replica_id"] == first["replica_id"]]
    out["reason"] = lost[0]["reason"] if lost else None
    return out


def handover(x: XhpcLike, name: str) -> dict[str, Any]:
    serve(x, name, "--time", "00:06:00")
    first = {r["replica_id"] for r in ready(x, name)}
    out: dict[str, Any] = {}
    try:
        with Load(x.proxy_port, name) as load:

            def handed_over() -> bool:
                now = rows(x, name, all_=True)
                new = [r for r in now if r["replica_id"] not in first and r["state"] == "READY"]
                old = [r for r in now if r["replica_id"] in first]
                return bool(new) and all(r["state"] in ("STOPPED", "DRAINING") for r in old)

            out["handed_over_s"] = until(handed_over, 600, 0.5)
            after = time.monotonic()
            until(lambda: load.ok_since(after) >= 3, 120, 0.2)
        out["requests"] = len(load.outcomes)
        out["failed"] = load.failed()
    finally:
        x.run("stop", name, check=False)
    return out


# -- the table ------------------------------------------------------------------------------------
def firsts(runs: Sequence[dict[str, Any]], key: str) -> list[float]:
    mine = [r for r in runs if r["contender"] == key and r["round"] >= 0]
    return [r["first_200_s"] for r in mine if r["first_200_s"] is not None]


def shown(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    runs = data.get("launch")
    if runs is not None:
        two, vec = firsts(runs, "xhpc-2"), firsts(runs, "vec-inf-2")
        if two and vec:
            a, b = statistics.median(two), statistics.median(vec)
            out.append({"target": TARGET_LAUNCH, "value": f"{a:.1f} s vs {b:.1f} s",
                        "met": a <= b})  # fmt: skip
        else:
            errors = sorted({str(r["error"])[:160] for r in runs
                             if r["contender"] == "vec-inf-2" and r["error"]})  # fmt: skip
            why = "; ".join(errors) or "no answer"
            value = f"not measured: vec-inf's 2-node job never answered ({why})"
            out.append({"target": TARGET_LAUNCH, "value": value, "met": False})
    loss = data.get("loss")
    if loss is not None:
        s, r = loss.get("out_of_rotation_s"), loss.get("replacement_ready_s")
        met = s is not None and s <= OUT_OF_ROTATION_S and r is not None
        value = f"out after {s if s is None else round(s, 1)} s, replacement READY after " \
                f"{r if r is None else round(r, 1)} s"  # fmt: skip
        out.append({"target": TARGET_LOSS, "value": value, "met": met})
    hand = data.get("handover")
    if hand is not None:
        failed = hand.get("failed", ["not run"])
        done = hand.get("handed_over_s") is not None
        out.append({"target": TARGET_HANDOVER, "met": done and not failed,
                    "value": f"{len(failed)} failed of {hand.get('requests', 0)}"
                             + ("" if done else "; no handover within 600 s")})  # fmt: skip
    return out


def table(data: dict[str, Any]) -> str:
    lines = ["| part | contender / figure | seconds: median [min, max] or value |", "|---|---|---|"]
    for key in KEYS:
        runs = data.get("launch") or []
        if runs:
            fails = sum(1 for r in runs if r["contender"] == key and r["error"])
            note = f" ({fails} failed)" if fails else ""
            lines.append(f"| launch -> first answer | {LABELS[key]} | "
                         f"{shown(firsts(runs, key))}{note} |")  # fmt: skip
    two, one = (
        firsts(data.get("launch") or [], "xhpc-2"),
        firsts(data.get("launch") or [], "xhpc-1"),
    )
    if two and one:
        ratio = statistics.median(two) / statistics.median(one)
        lines.append(f"| launch -> first answer | xhpc 2 nodes / 1 node | {ratio:.2f}x |")
    for part, keys in (("loss", ("out_of_rotation_s", "replacement_ready_s")),
                       ("handover", ("handed_over_s", "requests"))):  # fmt: skip
        got = data.get(part)
        if not got:
            continue
        for k in keys:
            value = got.get(k)
            shown_value = f"{value:.1f}" if isinstance(value, float) else str(value)
            lines.append(f"| {part} | {k} | {shown_value} |")
        if part == "handover":
            lines.append(f"| handover | failed requests | {len(got.get('failed', []))} |")
    lines.append("")
    lines += target_lines(data["targets"])
    return "\n".join(lines)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tests.conftest import own_xhpc

    data: dict[str, Any] = {"rounds": args.rounds}
    with own_xhpc(MODEL_DIR, engine.user_toml(RESOURCES) + USER_TOML) as x:
        if "launch" not in args.skip:
            user = work / "xhpc-user.toml"
            user.write_text(engine.user_toml(RESOURCES))
            config = engine.xhpc_config(user, work / "xhpc-plan-state")
            _, spec = engine.xhpc_plan(config, "mn-check", RESOURCES)
            cmd: VllmCommand = engine.vllm_command(spec, work / "jobs")
            dirs = vecinf.VecInfDirs(work / "vec-inf")
            dirs.prepare()
            contenders: dict[str, Contender] = {
                "xhpc-2": XhpcNodes(x, work, 2),
                "xhpc-1": XhpcNodes(x, work, 1),
                "vec-inf-2": VecInfNodes(dirs, cmd, Resources(), Nodes()),
            }
            runs: list[Run] = []
            launches: list[Launch] = []
            try:
                measure(contenders, args.rounds, args.timeout, f"{os.getpid()}", runs,
                        launches, None)  # fmt: skip
            finally:
                cancel_left(launches)
            data["launch"] = [r.record() for r in runs]
        if "loss" not in args.skip:
            data["loss"] = node_loss(x, f"mn-loss-{os.getpid()}")
            log(f"node loss: {data['loss']}")
        if "handover" not in args.skip:
            data["handover"] = handover(x, f"mn-hand-{os.getpid()}")
            log(f"handover: {data['handover']}")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_on_tiny_model(
        "multinode", args.json, lambda work: run(args, work), targets, table, MODEL_DIR
    )


if __name__ == "__main__":
    sys.exit(main())
