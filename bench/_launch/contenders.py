"""The three contenders, each the same vLLM job started another way, behind one interface for
the poll loop (measure.py): what a round's launch command is and which Slurm job name it
submits under (unique per round), the job id in its output, where its server answers once
known, and how its job is stopped.

    plain    ``sbatch --parsable SCRIPT``: a script that picks a free port on the node, writes
             it to a file for the bench, and execs vLLM as xhpc's agent would (same argv, same
             environment; ``--plain-vllm-serve``: as vec-inf does, ``vllm serve``)
    vec-inf  ``vec-inf launch MODEL --config FILE --json-mode`` (venv mode, .venvs/vllm); the
             port from the job's JSON (or vLLM's log line), the node's address from sinfo
    xhpc     ``xhpc serve tiny-llama --name NAME --engine vllm --detach --json`` against the
             bench's own broker and proxy; answers come through the proxy. ``--xhpc-follow``:
             without ``--detach`` (the command returns once READY and routed), the proxy asked
             only after it returned
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench._common import clean_env

from . import vecinf
from .cluster import job_rows, node_addresses, scancel, slurm_env, wait_gone
from .engine import PORT_SH, VllmCommand, exec_line, export_lines
from .params import GONE_TIMEOUT_S, MODEL, TIMEOUT_S, Resources, log

# Not passed to sbatch or vec-inf (the jobs inherit sbatch's environment): what would change the
# engine or the submission
DROP_ENV = (
    "XHPC_", "VLLM_", "VEC_INF_", "SLURM_", "HF_", "TRANSFORMERS_", "PYTHON", "OMP_", "MKL_",
)  # fmt: skip
PICK_PORT = (
    'PORT=$(python3 -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
    "print(s.getsockname()[1])')"
)


@dataclass
class Launch:
    """One contender's launch in one round."""

    key: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    job_name: str  # unique to this launch: how squeue finds its job before the id is known
    served: str  # the model name the chat request asks for
    stdout: Path
    stderr: Path
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    """What one launch did, in seconds since its command started (None: not reached)."""

    launch: Launch
    round: int  # -1: the warm-up
    slot: int  # its place in the round's order
    job_id: str | None = None
    node: str | None = None
    submit_s: float | None = None
    running_s: float | None = None
    first_200_s: float | None = None
    error: str | None = None
    left_jobs: list[str] = field(default_factory=list)  # not gone after the stop

    def record(self) -> dict[str, Any]:
        """The figures ``--json`` writes for this run."""
        return {
            "contender": self.launch.key,
            "round": self.round,
            "slot": self.slot,
            "job_name": self.launch.job_name,
            "job_id": self.job_id,
            "node": self.node,
            "submit_s": self.submit_s,
            "running_s": self.running_s,
            "first_200_s": self.first_200_s,
            "error": self.error,
            "left_jobs": self.left_jobs,
        }


class Contender(Protocol):
    key: str

    def prepare(self, tag: str) -> Launch: ...

    def job_id(self, launch: Launch, stdout: str) -> str | None: ...

    def endpoint(self, run: Run) -> tuple[str, int] | None: ...

    def stop(self, run: Run) -> list[str]: ...


class Nodes:
    """Node name -> address (sinfo), read again when a node is not known yet."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}

    def address(self, node: str) -> str | None:
        if node not in self.addresses:
            self.addresses = node_addresses()
        return self.addresses.get(node)


def submit_env() -> dict[str, str]:
    """The environment sbatch and vec-inf run with (and their jobs inherit)."""
    return slurm_env(clean_env(DROP_ENV))


def cancel_own(run: Run) -> list[str]:
    """scancel this run's job (its id, and any job under its unique name); the ids left."""
    rows = job_rows(names=[run.launch.job_name]) or []
    scancel({r.job_id for r in rows} | ({run.job_id} if run.job_id else set()))
    return wait_gone([run.launch.job_name], GONE_TIMEOUT_S)


def read_port(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class PlainSbatch:
    """A plain sbatch script that runs vLLM."""

    key = "plain"

    def __init__(
        self, work: Path, cmd: VllmCommand, res: Resources, nodes: Nodes, vllm_serve: bool
    ) -> None:
        self.work, self.cmd, self.res, self.nodes = work, cmd, res, nodes
        self.vllm_serve = vllm_serve

    def vllm_argv(self, served: str) -> list[str]:
        form = self.cmd.serve_argv if self.vllm_serve else self.cmd.module_argv
        return form(served, PORT_SH)

    def script(self, name: str, served: str, port_file: Path) -> str:
        r = self.res
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={name}",
            "#SBATCH --nodes=1",
            "#SBATCH --ntasks=1",
            f"#SBATCH --cpus-per-task={r.cpus}",
            f"#SBATCH --gres=gpu:{r.gpus}",
            f"#SBATCH --partition={r.partition}",
            f"#SBATCH --time={r.time}",
            f"#SBATCH --mem={r.mem_mb}M",
            f"#SBATCH --output={self.work}/{name}.%j.out",
            "# bench/launch.py's baseline: vLLM on a free port of the node, written for the bench",
            *export_lines(self.cmd.env),
            PICK_PORT,
            f'echo "$PORT" > {shlex.quote(f"{port_file}.tmp")} && '
            f"mv {shlex.quote(f'{port_file}.tmp')} {shlex.quote(str(port_file))}",
            exec_line(self.vllm_argv(served)),
        ]
        return "\n".join(lines) + "\n"

    def prepare(self, tag: str) -> Launch:
        name = f"lb-{tag}-plain"
        port_file = self.work / f"{name}.port"
        path = self.work / f"{name}.sbatch"
        path.write_text(self.script(name, MODEL, port_file))
        return Launch(
            key=self.key, argv=["sbatch", "--parsable", str(path)], env=submit_env(),
            cwd=self.work, job_name=name, served=MODEL, stdout=self.work / f"{name}.submit.out",
            stderr=self.work / f"{name}.submit.err", extra={"port_file": str(port_file)},
        )  # fmt: skip

    def job_id(self, launch: Launch, stdout: str) -> str | None:
        word = stdout.strip().split(";")[0]
        return word if word.isdigit() else None

    def endpoint(self, run: Run) -> tuple[str, int] | None:
        if run.node is None:
            return None
        port = read_port(Path(run.launch.extra["port_file"]))
        host = self.nodes.address(run.node) if port else None
        return (host, port) if host and port else None

    def stop(self, run: Run) -> list[str]:
        return cancel_own(run)


class VecInf:
    """`vec-inf launch` of the round's model entry."""

    key = "vec-inf"

    def __init__(
        self, dirs: vecinf.VecInfDirs, cmd: VllmCommand, res: Resources, nodes: Nodes
    ) -> None:
        self.dirs, self.cmd, self.res, self.nodes = dirs, cmd, res, nodes

    def prepare(self, tag: str) -> Launch:
        model = f"{vecinf.FAMILY}-{tag}"
        config = vecinf.write_models(self.dirs, model, self.cmd, self.res)
        return Launch(
            key=self.key, argv=vecinf.launch_argv(model, config),
            env=self.dirs.env(submit_env()), cwd=self.dirs.work_dir,
            job_name=vecinf.job_name(model), served=model,
            stdout=self.dirs.root / f"{model}.launch.out",
            stderr=self.dirs.root / f"{model}.launch.err",
        )  # fmt: skip

    def job_id(self, launch: Launch, stdout: str) -> str | None:
        return vecinf.launched_job_id(stdout)

    def endpoint(self, run: Run) -> tuple[str, int] | None:
        if run.node is None or run.job_id is None:
            return None
        port = vecinf.server_port(self.dirs, run.launch.served, run.job_id)
        host = self.nodes.address(run.node) if port else None
        return (host, port) if host and port else None

    def stop(self, run: Run) -> list[str]:
        return cancel_own(run)  # what `vec-inf shutdown JOB` does: scancel JOB


class XhpcLike(Protocol):
    """tests/conftest.py's ``Xhpc``: the bench's own broker and proxy."""

    proxy_port: int
    env: dict[str, str]

    def run(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]: ...


class XhpcServe:
    """`xhpc serve` through the bench's own broker; answers through its proxy."""

    key = "xhpc"

    def __init__(
        self, x: XhpcLike, xhpc_bin: str, work: Path, res: Resources, follow: bool
    ) -> None:
        self.x, self.xhpc_bin, self.work, self.res = x, xhpc_bin, work, res
        self.follow = follow

    def argv(self, name: str) -> list[str]:
        r = self.res
        argv = [
            self.xhpc_bin, "serve", MODEL, "--name", name, "--engine", "vllm",
            "--gpus", str(r.gpus), "--partition", r.partition, "--time", r.time, "--json",
        ]  # fmt: skip
        return argv + (["--timeout", str(int(TIMEOUT_S))] if self.follow else ["--detach"])

    def prepare(self, tag: str) -> Launch:
        name = f"lb-{tag}"
        work = self.work
        return Launch(
            key=self.key, argv=self.argv(name), env=dict(self.x.env), cwd=work,
            job_name=f"xhpc-{name}-0", served=name, stdout=work / f"{name}.serve.out",
            stderr=work / f"{name}.serve.err",
        )  # fmt: skip

    def job_id(self, launch: Launch, stdout: str) -> str | None:
        try:
            job = json.loads(stdout)["replicas"][0]["job_id"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        return str(job) if job else None

    def endpoint(self, run: Run) -> tuple[str, int] | None:
        if self.follow and run.submit_s is None:
            return None  # `xhpc serve` then a chat request
        return ("127.0.0.1", self.x.proxy_port)

    def stop(self, run: Run) -> list[str]:
        """`xhpc stop NAME` (a scancel would have the broker replace the job); when that fails
        (the broker is gone: ^C reaches it too), scancel."""
        done = self.x.run("stop", run.launch.served, check=False, timeout=GONE_TIMEOUT_S + 30)
        if done.returncode != 0:
            log(f"xhpc stop {run.launch.served} exited {done.returncode}: {done.stderr[-300:]}")
            return cancel_own(run)
        return wait_gone([run.launch.job_name], GONE_TIMEOUT_S)
