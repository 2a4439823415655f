"""Launch -> first answer: the same vLLM server started three ways on the dev Slurm cluster,
interleaved (docs/performance.md).

Contenders, one job at a time, each round in an order rotated by the round's number:

    plain sbatch  a script that picks a free port on the node, writes it to a file for the
                  bench, and execs vLLM exactly as xhpc's agent does (``--plain-vllm-serve``:
                  as vec-inf does, ``vllm serve``)
    vec-inf       ``vec-inf launch MODEL --config FILE --json-mode``: vec-inf 0.9.0 in venv mode
                  with .venvs/vllm
    xhpc serve    ``xhpc serve tiny-llama --engine vllm --detach`` against a broker and a proxy
                  of the bench's own; the answer comes through the proxy (``--xhpc-follow``:
                  without ``--detach``, i.e. the command returns once READY and routed, and
                  the proxy is asked only then)

The same job three ways: vLLM's argv and environment are what xhpc's agent gives the replica
xhpc's broker plans for that command (xhpc/agent/engines.py; site-configs/dev-cluster.toml's
``[engines.vllm]``: ``--enforce-eager --max-model-len 512 --kv-cache-memory-bytes 67108864
--dtype float32``; OMP_NUM_THREADS=1, HF_HUB_OFFLINE=1, ...), with the node's address and a
cache directory of the job's own filled in by the job; the Slurm resources are the same (1 GPU
gres, 1 CPU, 4 GB, partition gpu, 30 min; xhpc gets the memory from a user config of the
bench's). Before it measures, the bench renders all three jobs offline (vec-inf's script through
vec-inf itself, xhpc's through its planner) and refuses to run if they differ in resources or
in vLLM's model, arguments or environment; ``--dry-run`` prints the three scripts and stops.

Measured, per round and contender, in seconds from the launch command's start, by one poll
loop for all three (bench/_launch/measure.py; squeue and the server every 0.05 s): the command
returned ("submit"), the job seen RUNNING in squeue, and the first HTTP 200 of a chat completion
with ``max_tokens`` 1 (launch -> first answer). One untimed plain-sbatch launch first puts
vLLM's files in the page cache (``--no-warmup``: none). Table: per phase the median [min, max]
of each contender and its difference to plain sbatch (round by round, then the median).
Targets (``--json``): xhpc serve -> first answer through the proxy within 0.5 s of plain sbatch,
and xhpc ahead of vec-inf (both the median of the round-by-round differences).

vec-inf 0.9.0 as run here (scripts/setup-bench installs it into .venvs/vec-inf by name and
version; it brings click, pydantic, PyYAML, requests and rich, no torch and no vLLM: the job
activates .venvs/vllm):

- Configuration: ``--config FILE`` is vec-inf's only model list (bench/_launch/
  vec_inf_models.yaml, filled in per round: every path comes from the repository's root at run
  time); the cluster environment is ``$VEC_INF_CONFIG_DIR/environment.yaml``, read when vec-inf
  is imported, each top-level key replacing the shipped section of that name
  (bench/_launch/vec_inf_environment.yaml: no account or work directory required).
- ``vec-inf launch`` writes the job script, runs ``sbatch`` through a shell (any text on
  sbatch's stderr is an error for it, though the job may be queued), and only after sbatch
  returned creates the job's log directory LOG_DIR/FAMILY/MODEL.JOBID/ (its --output and --error
  go there) and the job's JSON of launch parameters; with ``--json-mode`` it prints them,
  the job id included. Each vec-inf command pays ~1 s of Python start-up.
- The job: venv mode (``venv`` is a path, not "apptainer": ``source VENV/bin/activate``), the
  config's ``env`` as unquoted ``export K=V`` lines, a port found by trying random ports of
  8080-65535 with ``nc -l $SLURMD_NODENAME PORT`` (netcat-openbsd, 0.1 s a try; Debian's
  package, scripts/setup-bench), ``server_address`` merged into the job's JSON with jq, then
  ``vllm serve PATH --served-model-name MODEL --host 0.0.0.0 --port P`` and the ``vllm_args``.
- The dev nodes' names (n1..n3) resolve nowhere, so the config sets SLURMD_NODENAME to the node's
  own address for the job (nc's listen address, and the host in ``server_address``). The bench
  takes the port from the job's JSON and the node's address from sinfo, as for the plain job.
- The model: the round's model name is unique (it is the Slurm job name, with "-vec-inf"), and
  ``hf_model`` points vLLM at models/tiny-llama, the path the others load.
- Not used: ``vec-inf status``/``wait_until_ready`` (READY once uvicorn's startup line is in the
  job's .err and GET /health answers; the client polls every 10 s by default) and ``vec-inf
  shutdown JOB`` (it is ``scancel JOB``; the bench cancels its own job ids).

Races (the dev cluster starts a job at once): a vec-inf job that starts before vec-inf made its
log directory cannot open its output; such a run fails ("the job ended ...") and is listed
under the table, its job cancelled. The job's jq may merge ``server_address`` before vec-inf
writes the JSON, which then loses it: the port is then read from vLLM's "Starting vLLM server
on ..." line in the job's output. Every run has a deadline (``--timeout``, 600 s); every run's
job is stopped before the next one starts (plain and vec-inf: scancel of its id; xhpc: ``xhpc
stop``) and waited out of squeue; on any exit (an error, ^C, SIGTERM) the jobs under the names
this run used are cancelled and the broker and proxy stopped, their jobs cancelled.

Needs the dev cluster (scripts/dev-cluster up), .venvs/vllm (scripts/setup-engines vllm),
.venvs/vec-inf, netcat-openbsd and jq (scripts/setup-bench), and models/tiny-llama (made if
missing). Run it with .venv's python. Exit status 0 when every run answered.

    .venv/bin/python bench/launch.py [--rounds 3] [--json FILE] [--keep] [--timeout S]
        [--no-warmup] [--xhpc-follow] [--plain-vllm-serve] [--dry-run]
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
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common, bench._launch, tests.conftest

from bench._common import emit, ensure_tiny_model, exit_on_sigterm  # noqa: E402
from bench._launch import engine, vecinf  # noqa: E402
from bench._launch.contenders import (  # noqa: E402
    Contender,
    Launch,
    Nodes,
    PlainSbatch,
    Run,
    VecInf,
    XhpcLike,
    XhpcServe,
)
from bench._launch.engine import EngineCall, VllmCommand  # noqa: E402
from bench._launch.measure import cancel_left, measure  # noqa: E402
from bench._launch.params import (  # noqa: E402
    KEYS,
    MODEL,
    MODEL_DIR,
    POLL_S,
    RESOURCES,
    ROUNDS,
    TIMEOUT_S,
    VEC_INF_VENV,
    VEC_INF_VERSION,
    VLLM_VENV,
    log,
)
from bench._launch.table import summarize  # noqa: E402

XHPC = Path(sys.executable).parent / "xhpc"  # tests/conftest.py runs this one too
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default {ROUNDS})")
    ap.add_argument("--json", type=Path, help="also write the figures and targets here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (always on failures)")
    ap.add_argument(
        "--timeout", type=float, default=TIMEOUT_S,
        help=f"seconds a launch may take to answer (default {TIMEOUT_S:.0f})",
    )  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true", help="no untimed launch first")
    ap.add_argument(
        "--xhpc-follow", action="store_true",
        help="xhpc serve without --detach: it returns once READY and routed; the proxy is "
        "asked after",
    )  # fmt: skip
    ap.add_argument(
        "--plain-vllm-serve", action="store_true",
        help="the plain script runs `vllm serve` (vec-inf's form) instead of xhpc's "
        "`python -m vllm.entrypoints.openai.api_server`",
    )  # fmt: skip
    ap.add_argument(
        "--dry-run", action="store_true",
        help="render the three jobs, check they agree, print them; submit nothing",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.timeout <= 0:
        ap.error("--timeout must be positive")
    return args


def vec_inf_installed() -> bool:
    found = VEC_INF_VENV.glob(f"lib/python3*/site-packages/vec_inf-{VEC_INF_VERSION}.dist-info")
    return vecinf.VEC_INF.exists() and any(found)


def openbsd_netcat() -> bool:
    if shutil.which("nc") is None:
        return False
    proc = subprocess.run(["nc", "-h"], capture_output=True, text=True, timeout=10)
    return "OpenBSD netcat" in proc.stdout + proc.stderr


def missing(dry_run: bool) -> list[str]:
    """What the run needs and does not find (``dry_run``: only what rendering needs)."""
    gone = []
    if not vec_inf_installed():
        gone.append(f"vec-inf {VEC_INF_VERSION} in {VEC_INF_VENV} (scripts/setup-bench)")
    if dry_run:
        return gone
    if not XHPC.exists():
        gone.append(f"{XHPC}: run this with .venv/bin/python")
    if not (VLLM_VENV / "bin" / "vllm").exists():
        gone.append(f"{VLLM_VENV} (scripts/setup-engines vllm)")
    if not openbsd_netcat():
        gone.append("nc from Debian's netcat-openbsd (scripts/setup-bench)")
    if shutil.which("jq") is None:
        gone.append("jq (scripts/setup-bench)")
    if subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True).returncode != 0:
        gone.append("the dev cluster is not up (scripts/dev-cluster up)")
    return gone


@dataclass
class Setup:
    """The run's one vLLM command, vec-inf's directories, and the three jobs rendered."""

    cmd: VllmCommand
    vec_inf: vecinf.VecInfDirs
    scripts: dict[str, str]
    calls: dict[str, EngineCall]


def argv_call(argv: list[str], env: dict[str, str]) -> EngineCall:
    """How an argv of VllmCommand's starts vLLM (``--model PATH`` or ``serve PATH``)."""
    model = argv[argv.index("--model") + 1] if "--model" in argv else argv[2]
    return EngineCall(model_path=model, args=tuple(argv[argv.index("--port") + 2 :]), env=env)


def prepare(work: Path, args: argparse.Namespace) -> Setup:
    """xhpc's plan for the command (offline), the vLLM command from it, and the three jobs
    rendered: the plain script, vec-inf's (by vec-inf) and xhpc's (by its planner)."""
    user = work / "xhpc-user.toml"
    user.write_text(engine.user_toml(RESOURCES))
    config = engine.xhpc_config(user, work / "xhpc-plan-state")
    xhpc_script, spec = engine.xhpc_plan(config, "lb-check", RESOURCES)
    cmd = engine.vllm_command(spec, work / "jobs")
    dirs = vecinf.VecInfDirs(work / "vec-inf")
    dirs.prepare()
    plain = PlainSbatch(work, cmd, RESOURCES, Nodes(), args.plain_vllm_serve)
    model = f"{vecinf.FAMILY}-check"
    vec_inf_script = vecinf.render(
        dirs, model, vecinf.write_models(dirs, model, cmd, RESOURCES), os.environ
    )
    scripts = {
        "plain": plain.script("lb-check-plain", MODEL, work / "lb-check-plain.port"),
        "vec-inf": vec_inf_script,
        "xhpc": xhpc_script,
    }
    calls = {
        "plain": argv_call(plain.vllm_argv(MODEL), dict(cmd.env)),
        "vec-inf": vecinf.engine_call(vec_inf_script),
        "xhpc": argv_call(cmd.module_argv(MODEL, "0"), dict(cmd.env)),
    }
    return Setup(cmd=cmd, vec_inf=dirs, scripts=scripts, calls=calls)


def parity(setup: Setup) -> list[str]:
    resources = {k: engine.sbatch_resources(setup.scripts[k]) for k in KEYS}
    return engine.parity_problems(resources, {k: setup.calls[k] for k in KEYS})


def print_scripts(setup: Setup) -> None:
    for key in KEYS:
        print(f"# ---- {key}: {engine.sbatch_resources(setup.scripts[key])} ----")
        print(setup.scripts[key].rstrip() + "\n")


def wait_for_proxy(port: int, timeout_s: float = 60.0) -> None:
    from bench._continuity.sampling import proxy_routes

    deadline = time.monotonic() + timeout_s
    while proxy_routes(port) < 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not answer on port {port} within {timeout_s:.0f} s")
        time.sleep(0.2)


def build_contenders(
    setup: Setup, x: XhpcLike, work: Path, args: argparse.Namespace
) -> dict[str, Contender]:
    nodes = Nodes()
    return {
        "plain": PlainSbatch(work, setup.cmd, RESOURCES, nodes, args.plain_vllm_serve),
        "vec-inf": VecInf(setup.vec_inf, setup.cmd, RESOURCES, nodes),
        "xhpc": XhpcServe(x, str(XHPC), work, RESOURCES, args.xhpc_follow),
    }


def run_all(setup: Setup, work: Path, args: argparse.Namespace, runs: list[Run]) -> int:
    """Start the bench's broker and proxy, measure, and tear everything down however it ends;
    the exit status (130 or SIGTERM's when interrupted)."""
    from tests.conftest import own_xhpc

    launches: list[Launch] = []
    try:
        with own_xhpc(MODEL_DIR, engine.user_toml(RESOURCES)) as x:
            wait_for_proxy(x.proxy_port)
            log(f"broker and proxy up (proxy port {x.proxy_port}); {args.rounds} rounds")
            try:
                measure(
                    build_contenders(setup, x, work, args), args.rounds, args.timeout,
                    f"{os.getpid()}", runs, launches, None if args.no_warmup else "plain",
                )  # fmt: skip
            finally:
                left = cancel_left(launches)
                if left:
                    log(f"WARNING: jobs still in squeue after scancel: {', '.join(left)}")
    except (KeyboardInterrupt, SystemExit) as stop:
        log(f"interrupted ({stop!r}): the table has the runs that ended before")
        code = stop.code if isinstance(stop, SystemExit) else None
        return code if isinstance(code, int) and code else 130
    return 0


def run_params(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "rounds": args.rounds,
        "poll_s": POLL_S,
        "timeout_s": args.timeout,
        "warmup": not args.no_warmup,
        "xhpc_follow": args.xhpc_follow,
        "plain_vllm_serve": args.plain_vllm_serve,
        "vec_inf": VEC_INF_VERSION,
        "resources": asdict(RESOURCES),
        "vllm_argv": setup.cmd.module_argv("SERVED", "PORT"),
        "vllm_env": dict(setup.cmd.env),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gone = missing(args.dry_run)
    if gone:
        for what in gone:
            log(f"ERROR: not found: {what}")
        return 1
    ensure_tiny_model(log, MODEL_DIR)
    exit_on_sigterm()
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="xhpc-bench-launch-", dir="/tmp"))  # seen by the nodes
    try:
        setup = prepare(work, args)
    except (RuntimeError, ValueError, OSError) as err:
        log(f"ERROR: {err}")
        shutil.rmtree(work, ignore_errors=True)
        return 1
    problems = parity(setup)
    if args.dry_run:
        print_scripts(setup)
    for problem in problems:
        log(f"ERROR: the three jobs differ: {problem}")
    if args.dry_run or problems:
        shutil.rmtree(work, ignore_errors=True)
        return 1 if problems else 0
    runs: list[Run] = []
    status = run_all(setup, work, args, runs)
    records = [r.record() for r in runs]
    emit(summarize(records, run_params(setup, args)), t_start, args.json)
    failed = any(r["error"] or r["left_jobs"] for r in records)
    if args.keep or failed or status:
        log(f"kept {work} (job scripts, outputs, vec-inf's logs)")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
