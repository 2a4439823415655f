"""Cold vs staged start: the weights cache's gain when the shared filesystem is slow, on the dev
Slurm cluster (docs/performance.md).

The shared store is a FUSE passthrough with a read-bandwidth cap (bench/_throttle.py: direct_io,
allow_other, one cap for all readers) over a work directory holding a random-weight Llama of
``--mb`` MB (bench/_cache_model.py; the tiny model's tokenizer): the site's ``models_dir`` is the
mount. Contenders, each a real ``xhpc serve cache-llama --engine transformers`` on the dev cluster,
interleaved over ``--rounds`` rounds (the cold run first in even rounds, last in odd ones):

    cold            a broker and proxy whose config has no ``[cache] local_dir``: the engine loads
                    its weights through the cap
    staged, first   a second broker and proxy with ``[cache] local_dir`` (in its state directory),
                    the node's copy removed before (``xhpc cache rm``, a job on the node): the
                    agent copies the weights through the cap, digests the copy, and the engine
                    loads it (``--nodelist`` n2, then n3: not the node placement picks by name)
    staged, warm    the same broker again, no ``--nodelist``: the copy is on the node; placement
                    should put the replica there and say so ("holds cache-llama locally"), and
                    the agent reuses the copy (its digest computed again) for the engine

Time = the ``xhpc serve`` command's start -> its return (it returns once READY and routed),
each start made once every node's GPUs are free in the broker's view (untimed). The
node comes from ``xhpc ps --json``, the placement's reason from the broker's log of that start
(idle placements are logged: "placement of replica 0: n2: idle, ..., holds cache-llama
locally"). Before any start: the throttle's cap is checked by reading the weights through the
mount (MB/s ~ cap), and each broker has digested the shared copy (``xhpc cache ls``: the ledger
reads it once, through the cap) so that no start shares the cap with it.

Table: per contender the median [min, max] seconds and the ratio to cold (round by round, then
the median). Targets (``--json``), for the default size and cap: warm start >= 1.5x faster than
cold; warm saves >= 70% of the weights' read time at the cap (size / cap); staged first start
<= 1.25x cold; the warm replica on the node holding the copy, the reason saying so, every
round; the mount reads at the cap (0.8-1.02x).

Needs the dev cluster (scripts/dev-cluster up), .venvs/transformers (scripts/setup-engines
transformers), .venvs/mfusepy and Debian's fuse3 (scripts/setup-bench), /dev/fuse, and
models/tiny-llama (made if missing). Run it with .venv's python. Exit status 0 when every start
answered.

    .venv/bin/python bench/cache.py [--rounds 3] [--mb 200] [--cap 10] [--quick] [--json FILE]
        [--keep] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, tests.conftest

from bench._common import (  # noqa: E402
    Procs,
    Summary,
    emit,
    ensure_tiny_model,
    exit_on_sigterm,
    logger,
    med,
    spread,
    wait,
)
from bench._throttle import fuse_usable, unmount  # noqa: E402

log = logger("cache")
MODEL = "cache-llama"
CONTENDERS = ("cold", "staged, first", "staged, warm")
COLD, FIRST, WARM = CONTENDERS
ROUNDS = 3
MB = 200.0
CAP_MB_S = 10.0
QUICK_MB = 100.0
TIMEOUT_S = 600.0
READ_CHUNK = 1 << 20
TARGET_WARM_X = 1.5
TARGET_SAVED = 0.7
TARGET_FIRST_X = 1.25
CAP_RANGE = (0.8, 1.02)
XHPC = Path(sys.executable).parent / "xhpc"
TF_PYTHON = ROOT / ".venvs" / "transformers" / "bin" / "python"
FUSE_PYTHON = ROOT / ".venvs" / "mfusepy" / "bin" / "python"
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"
# The model as a catalog entry (user config layer) under models_dir, the throttled mount: the
# ledger digests catalog models of the shared store, and a copy is named by its deployment.
CATALOG_TOML = f'[models.{MODEL}]\npath = "{MODEL}"\ndescription = "bench/cache.py"\n'
CACHE_TOML = CATALOG_TOML + '\n[cache]\nlocal_dir = "@STATE@/local"\n'


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=None, help=f"rounds (default {ROUNDS})")
    ap.add_argument("--mb", type=float, default=None, help=f"model size in MB (default {MB:.0f})")
    ap.add_argument(
        "--cap", type=float, default=CAP_MB_S,
        help=f"the shared mount's read cap, MB/s (default {CAP_MB_S:.0f})",
    )  # fmt: skip
    ap.add_argument(
        "--quick", action="store_true",
        help=f"a fast cluster check: 1 round, a {QUICK_MB:.0f} MB model (unless given)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the figures and targets here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (always on failures)")
    ap.add_argument(
        "--timeout", type=float, default=TIMEOUT_S,
        help=f"seconds one start may take (default {TIMEOUT_S:.0f})",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else ROUNDS
    if args.mb is None:
        args.mb = QUICK_MB if args.quick else MB
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.mb <= 0 or args.cap <= 0 or args.timeout <= 0:
        ap.error("--mb, --cap and --timeout must be positive")
    return args


def order(round_no: int) -> tuple[str, ...]:
    """The contenders of a round: cold first in even rounds, last in odd ones (warm always right
    after first: it needs the copy first made)."""
    return CONTENDERS if round_no % 2 == 0 else (FIRST, WARM, COLD)


def first_node(round_no: int) -> str:
    """Where the first staged start goes: n2, n3, n2, ... (never n1, the node placement takes
    by name among idle ones, so that the warm start's node shows the cache's preference)."""
    return f"n{2 + round_no % 2}"


# ---- the table and the targets (pure: tests/test_bench_cache.py) ----------------------------


def _ratios(records: list[dict[str, Any]], num: str, den: str) -> list[float]:
    """Per round, seconds of ``num`` / seconds of ``den`` (rounds where both answered)."""
    by: dict[tuple[int, str], float] = {
        (r["round"], r["contender"]): r["seconds"] for r in records if r["seconds"] is not None
    }
    rounds = sorted({r["round"] for r in records})
    return [by[(n, num)] / by[(n, den)] for n in rounds if (n, num) in by and (n, den) in by]


def summarize(records: list[dict[str, Any]], params: dict[str, Any]) -> Summary:
    """The table and the figures: ``records`` are one dict per start (round, contender, seconds
    or None, node, error, and for warm starts ``on_copy_node``/``reason_ok``); ``params`` has
    ``mb`` (the weights' size), ``cap_mb_s`` and ``read_mb_s`` (the mount's measured rate)."""
    seconds = {
        c: [r["seconds"] for r in records if r["contender"] == c and r["seconds"] is not None]
        for c in CONTENDERS
    }
    runs = {c: sum(1 for r in records if r["contender"] == c) for c in CONTENDERS}
    vs_cold = {c: _ratios(records, c, COLD) for c in CONTENDERS}
    faster = _ratios(records, COLD, WARM)  # cold / warm: how many times faster warm starts
    saved = [
        cold - warm
        for cold, warm in (
            (_by(records, n, COLD), _by(records, n, WARM)) for n in sorted(_rounds(records))
        )
        if cold is not None and warm is not None
    ]
    read_s = params["mb"] / params["cap_mb_s"]
    rows = [
        f"start = `xhpc serve` -> READY and routed; {params['mb']:.0f} MB of weights, shared "
        f"mount capped at {params['cap_mb_s']:.0f} MB/s (read {params['read_mb_s']:.1f} MB/s "
        f"measured: {read_s:.1f} s for the weights at the cap); seconds, median [min, max]",
        "",
        "| contender | start s | vs cold | answered |",
        "|---|---|---|---|",
    ]
    for c in CONTENDERS:
        ratio = spread(vs_cold[c], scale=1, digits=2)
        rows.append(
            f"| {c} | {spread(seconds[c], scale=1, digits=2)} | {ratio}x | "
            f"{len(seconds[c])}/{runs[c]} |"
        )
    warm = [r for r in records if r["contender"] == WARM]
    placed = sum(1 for r in warm if r.get("on_copy_node") and r.get("reason_ok"))
    rows.append(
        f"\nwarm vs cold: {spread(faster, scale=1, digits=2)}x faster, "
        f"{spread(saved, scale=1, digits=2)} s saved per start"
    )
    rows.append(
        f"warm replica on the node holding the copy, placement reason saying so: "
        f"{placed}/{len(warm)}"
    )
    for r in records:
        if r.get("error"):
            rows.append(f"round {r['round']} {r['contender']}: {r['error']}")
    med_faster, med_saved = med(faster), med(saved)
    ratio_cap = params["read_mb_s"] / params["cap_mb_s"]
    data: dict[str, Any] = {
        "params": params,
        "runs": records,
        "seconds": {c: seconds[c] for c in CONTENDERS},
        "vs_cold": vs_cold,
        "warm_faster_x": faster,
        "warm_saved_s": saved,
    }
    data["targets"] = [
        {
            "target": f"warm start >= {TARGET_WARM_X}x faster than cold at the cap",
            "value": f"{med_faster:.2f}x",
            "met": med_faster >= TARGET_WARM_X,
        },
        {
            "target": f"warm saves >= {TARGET_SAVED:.0%} of the weights' read time at the cap "
            f"({read_s:.1f} s)",
            "value": f"{med_saved:.2f} s ({med_saved / read_s:.0%})",
            "met": med_saved >= TARGET_SAVED * read_s,
        },
        {
            "target": f"staged first start <= {TARGET_FIRST_X}x cold",
            "value": f"{med(vs_cold[FIRST]):.2f}x",
            "met": med(vs_cold[FIRST]) <= TARGET_FIRST_X,
        },
        {
            "target": "warm replica placed on the node holding the copy, reason saying so",
            "value": f"{placed}/{len(warm)}",
            "met": bool(warm) and placed == len(warm),
        },
        {
            "target": f"the mount reads at the cap ({CAP_RANGE[0]}-{CAP_RANGE[1]}x)",
            "value": f"{params['read_mb_s']:.1f} MB/s ({ratio_cap:.2f}x)",
            "met": CAP_RANGE[0] <= ratio_cap <= CAP_RANGE[1],
        },
    ]
    return Summary("\n".join(rows), data)


def _rounds(records: list[dict[str, Any]]) -> set[int]:
    return {r["round"] for r in records}


def _by(records: list[dict[str, Any]], round_no: int, contender: str) -> float | None:
    for r in records:
        if r["round"] == round_no and r["contender"] == contender:
            return r["seconds"]  # type: ignore[no-any-return]
    return None


# ---- the run (the dev cluster) ----------------------------------------------------------------


def missing() -> list[str]:
    gone = []
    if not XHPC.exists():
        gone.append(f"{XHPC}: run this with .venv/bin/python")
    if not TF_PYTHON.exists():
        gone.append(f"{TF_PYTHON} (scripts/setup-engines transformers)")
    if not FUSE_PYTHON.exists():
        gone.append(f"{FUSE_PYTHON} (scripts/setup-bench)")
    why = fuse_usable()
    if why:
        gone.append(f"FUSE: {why}")
    if subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True).returncode != 0:
        gone.append("the dev cluster is not up (scripts/dev-cluster up)")
    return gone


def make_model(store: Path, mb: float) -> Path:
    out = store / MODEL
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    subprocess.run(
        [str(TF_PYTHON), str(ROOT / "bench" / "_cache_model.py"), str(out), "--mb", str(mb),
         "--tokenizer-from", str(ROOT / "models" / "tiny-llama")],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def read_rate(model_dir: Path) -> tuple[float, float]:
    """Read every file of ``model_dir`` once: (MB read, MB/s)."""
    total = 0
    t0 = time.monotonic()
    for path in sorted(model_dir.iterdir()):
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                total += len(chunk)
    return total / 1e6, total / 1e6 / (time.monotonic() - t0)


class Broker:
    """One of the bench's brokers and proxies (tests/conftest.py's own_xhpc)."""

    def __init__(self, x: Any) -> None:
        self.x = x

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(XHPC), *args], env=self.x.env, capture_output=True, text=True, timeout=timeout
        )

    def json(self, *args: str) -> Any:
        import json

        done = self.run(*args, "--json")
        if done.returncode != 0:
            raise RuntimeError(f"xhpc {' '.join(args)}: {done.stderr.strip()[-500:]}")
        return json.loads(done.stdout)

    def shared_digested(self) -> bool:
        rows = self.json("cache", "ls")
        return any(r["node"] is None and r["model"] == MODEL and r["digest"] for r in rows)

    def copy_dir(self) -> Path:
        import getpass

        return Path(self.x.state_dir) / "local" / getpass.getuser() / MODEL

    def node_of(self, replica: str) -> str | None:
        row = next((r for r in self.json("ps") if r["replica_id"] == replica), None)
        return row["node"] if row else None

    def all_idle(self) -> bool:
        """Every node's GPUs free in the broker's view of Slurm (a cancelled job's allocation
        can outlive ``xhpc stop`` by a moment: placement puts free GPUs before the cache)."""
        return all(n["free"] == n["gpus_total"] for n in self.json("nodes")["nodes"])

    def log_size(self) -> int:
        path = Path(self.x.state_dir) / "broker.log"
        return path.stat().st_size if path.exists() else 0

    def placement_said_local(self, since: int, node: str) -> bool:
        """The broker logged, after byte ``since`` of its log, a placement on ``node`` whose
        reason says it holds the model ("placement of replica 0: n2: idle, 4 GPU(s) free,
        holds cache-llama locally"): idle placements are logged, not kept as events."""
        with (Path(self.x.state_dir) / "broker.log").open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return any(
            "placement of replica" in line and f": {node}: " in line
            and f"holds {MODEL} locally" in line
            for line in text.splitlines()
        )  # fmt: skip


def start(b: Broker, timeout_s: float, *extra: str) -> tuple[float | None, str, str | None]:
    """``xhpc serve`` until it returns: (seconds or None, the error, the replica's id)."""
    import json

    argv = ["serve", MODEL, "--engine", "transformers", "--gpus", "1", "--json", *extra]
    t0 = time.monotonic()
    try:
        done = b.run(*argv, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"no READY within {timeout_s:.0f} s", None
    took = time.monotonic() - t0
    if done.returncode != 0:
        return None, f"exit {done.returncode}: {done.stderr.strip()[-300:]}", None
    try:
        # the READY one: a deployment's view lists its earlier rounds' stopped replicas too
        rows = json.loads(done.stdout)["replicas"]
        replica = str([r for r in rows if r["state"] == "READY"][-1]["replica_id"])
    except (ValueError, KeyError, IndexError, TypeError):
        replica = None
    return took, "", replica


def one_start(
    brokers: dict[str, Broker], contender: str, round_no: int, timeout_s: float
) -> dict[str, Any]:
    b = brokers[COLD] if contender == COLD else brokers[FIRST]
    extra = ("--nodelist", first_node(round_no)) if contender == FIRST else ()
    if contender == FIRST:
        clear_copies(b)
    try:
        wait(b.all_idle, 60, "every node's GPUs to be free")
    except TimeoutError as err:
        log(f"WARNING: {err}; starting anyway")
    since = b.log_size()
    seconds, error, replica = start(b, timeout_s, *extra)
    record: dict[str, Any] = {
        "round": round_no, "contender": contender, "seconds": seconds, "error": error,
        "node": None, "replica": replica,
    }  # fmt: skip
    try:
        if replica is not None:
            record["node"] = b.node_of(replica)
        if contender == WARM:
            want = first_node(round_no)
            record["copy_node"] = want
            record["on_copy_node"] = record["node"] == want
            record["reason_ok"] = b.placement_said_local(since, want)
    finally:
        b.run("stop", MODEL, timeout=180)
    log(f"round {round_no} {contender}: {seconds if seconds is None else round(seconds, 2)} s "
        f"on {record['node']} {error}")  # fmt: skip
    return record


def clear_copies(b: Broker) -> None:
    """No node-local copy of the model: ``xhpc cache rm`` (a job on each node holding one),
    waited out. The dev nodes share one filesystem: one copy directory serves all three."""
    if any(r["node"] is not None and r["model"] == MODEL for r in b.json("cache", "ls")):
        done = b.run("cache", "rm", MODEL)
        if done.returncode != 0:
            raise RuntimeError(f"xhpc cache rm: {done.stderr.strip()}")
    wait(lambda: not b.copy_dir().exists(), 120, "the node-local copy to be removed")


def run_rounds(mount: Path, args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    from tests.conftest import own_xhpc

    model = mount / MODEL
    with own_xhpc(model, CATALOG_TOML) as cold_x, own_xhpc(model, CACHE_TOML) as cache_x:
        brokers = {COLD: Broker(cold_x), FIRST: Broker(cache_x)}
        for name, b in (("cold", brokers[COLD]), ("cache", brokers[FIRST])):
            wait(b.shared_digested, 300, f"the {name} broker to digest the shared copy")
        log(f"brokers up, shared copy digested; {args.rounds} round(s)")
        for n in range(args.rounds):
            for contender in order(n):
                records.append(one_start(brokers, contender, n, args.timeout))
        for b in brokers.values():
            b.run("cache", "rm", MODEL)  # leave no copy behind: best effort


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gone = missing()
    if gone:
        for what in gone:
            log(f"ERROR: not found: {what}")
        return 1
    ensure_tiny_model(log)
    exit_on_sigterm()
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="xhpc-bench-cache-", dir="/tmp"))  # seen by the nodes
    os.chmod(work, 0o755)
    store, mount = work / "store", work / "shared"
    mount.mkdir()
    procs = Procs(work)
    records: list[dict[str, Any]] = []
    status = 0
    params: dict[str, Any] = {}
    try:
        log(f"making a {args.mb:.0f} MB random Llama in {store}")
        size_mb = sum(p.stat().st_size for p in make_model(store, args.mb).iterdir()) / 1e6
        procs.start(
            "throttle",
            [str(FUSE_PYTHON), str(ROOT / "bench" / "_throttle.py"), str(store), str(mount),
             "--mb-s", str(args.cap)],
        )  # fmt: skip
        wait(lambda: os.path.ismount(mount), 20, "the throttled mount")
        read_mb, read_mb_s = read_rate(mount / MODEL)
        log(f"read {read_mb:.0f} MB through the mount at {read_mb_s:.1f} MB/s (cap {args.cap})")
        params = {
            "rounds": args.rounds, "quick": args.quick, "mb": size_mb, "cap_mb_s": args.cap,
            "read_mb_s": read_mb_s, "engine": "transformers",
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
        }  # fmt: skip
        run_rounds(mount, args, records)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        log(f"ERROR: {err}")
        status = 1
    except (KeyboardInterrupt, SystemExit) as stop:
        log(f"interrupted ({stop!r}): the table has the starts that ended before")
        code = stop.code if isinstance(stop, SystemExit) else None
        status = code if isinstance(code, int) and code else 130
    finally:
        procs.stop()  # SIGTERM to the throttle by its PID: libfuse leaves its loop, unmounts
        if not unmount(mount):
            log(f"WARNING: {mount} still mounted")
    if params:
        emit(summarize(records, params), t_start, args.json)
    failed = status or any(r["error"] for r in records) or not records
    if args.keep or failed:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
