"""The one vLLM server every contender starts and the one set of Slurm resources every job asks
for, both taken from xhpc itself: the replica the broker plans for ``xhpc serve tiny-llama
--engine vllm`` (``xhpc.broker.plan.planner.plan_deployment``, run here offline with the bench's own
config layers: the dev site config and a user file setting the memory), and the argv and
environment ``xhpc.agent.engines.engine_launch`` gives that replica's engine. Values known only
inside the job (the node's address, the job id) are shell expressions that bash expands in the
job: the plain script and vec-inf's both write the environment as unquoted ``export K=V``
lines. Also: the resources an sbatch script asks for (its ``#SBATCH`` lines, normalised) and the
check that the three jobs agree on them and on vLLM's model, arguments and environment.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from xhpc.agent.engines import engine_launch
from xhpc.broker.plan.planner import plan_deployment
from xhpc.catalog import resolve_model
from xhpc.config import load_config
from xhpc.models import AgentSpec, EngineKind, ServeRequest
from xhpc.settings import XhpcConfig

from .params import MODEL, MODEL_DIR, SITE, Resources

NODE_ADDR_SH = "$(hostname -I | cut -d' ' -f1)"  # the node's own address, inside its namespace
JOB_ID_SH = "$SLURM_JOB_ID"
PORT_SH = "$PORT"  # the plain script's port variable
_SERVED = "@SERVED@"
_PORT = 1  # engine_launch wants a number; its place in argv is replaced
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_./:,+=@%-]*")
_SBATCH = re.compile(r"^#SBATCH\s+--([a-z-]+)(?:=(\S+))?")
RESOURCE_KEYS = ("nodes", "ntasks", "cpus-per-task", "gres", "mem", "partition", "time")
_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def user_toml(res: Resources) -> str:
    """The bench's xhpc user config: the dev site's CPUs per replica, and memory like the others
    (the dev site sets none, and vec-inf always asks for some)."""
    return f"[slurm]\ncpus_per_replica = {res.cpus}\nmem_per_replica_mb = {res.mem_mb}\n"


def xhpc_config(
    user_file: Path, state_dir: Path, models_dir: Path = MODEL_DIR.parent
) -> XhpcConfig:
    """xhpc's config from the same layers as the bench's own broker (tests/conftest.py's
    ``own_xhpc``): the dev site config, ``user_file``, the models and state directories."""
    env = {
        "XHPC_SITE_CONFIG": str(SITE),
        "XHPC_USER_CONFIG": str(user_file),
        "XHPC_MODELS_DIR": str(models_dir),
        "XHPC_STATE_DIR": str(state_dir),
    }
    config, _ = load_config(env=env)
    return config


def serve_request(name: str, res: Resources) -> ServeRequest:
    """What ``xhpc serve tiny-llama --name NAME --engine vllm`` with the resources asks for."""
    return ServeRequest(
        model=MODEL, name=name, engine=EngineKind.VLLM, gpus=res.gpus,
        partition=res.partition, time=res.time,
    )  # fmt: skip


def xhpc_plan(config: XhpcConfig, name: str, res: Resources) -> tuple[str, AgentSpec]:
    """The sbatch script and the agent's spec the broker would plan (no node chosen: Slurm's
    placement is left out; it adds only ``--nodelist``)."""
    req = serve_request(name, res)
    model = resolve_model(req.model, config, req.name)
    plan = plan_deployment(req, model, config, start_index=0, agent_python=sys.executable)
    job = plan.jobs[0]
    return job.script, job.hosts[0].spec


@dataclass(frozen=True)
class VllmCommand:
    """vLLM as xhpc's agent starts it: argv (served name and port left to fill) and env."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    model_path: str
    args: tuple[str, ...]  # the site's [engines.vllm] args, after --port

    def module_argv(self, served: str, port: str) -> list[str]:
        """xhpc's form: ``python -m vllm.entrypoints.openai.api_server --model ...``."""
        argv = [served if a == _SERVED else a for a in self.argv]
        argv[argv.index("--port") + 1] = port
        return argv

    def serve_argv(self, served: str, port: str) -> list[str]:
        """vec-inf's form: ``vllm serve MODEL ...``, the same arguments."""
        vllm = str(Path(self.argv[0]).parent / "vllm")
        return [
            vllm, "serve", self.model_path, "--served-model-name", served, "--host", "0.0.0.0",
            "--port", port, *self.args,
        ]  # fmt: skip


def vllm_command(spec: AgentSpec, jobs_dir: Path) -> VllmCommand:
    """engine_launch of ``spec`` with the job-time values as shell expressions: the node's
    address, and a cache directory of the job's own under ``jobs_dir`` (the agent's is a fresh
    scratch directory too). No job environment is passed through and no API key is set: the
    plain and vec-inf jobs inherit sbatch's environment and check no key."""
    launch = engine_launch(
        spec.model_copy(update={"served_model": _SERVED}),
        host="0.0.0.0",
        port=_PORT,
        node_address=NODE_ADDR_SH,
        tmp_dir=jobs_dir / JOB_ID_SH,
        job_env={},
    )
    argv = tuple(launch.argv)
    args = argv[argv.index("--port") + 2 :]
    return VllmCommand(argv=argv, env=dict(launch.env), model_path=spec.model_path, args=args)


def job_value(value: str) -> str:
    """``value`` as it stands unquoted after ``export K=`` in a job script: plain characters
    and the job-time expressions only (vec-inf cannot quote)."""
    rest = value.replace(NODE_ADDR_SH, "").replace(JOB_ID_SH, "")
    if not _PLAIN_VALUE.fullmatch(rest):
        raise ValueError(f"cannot pass {value!r} unquoted in a job script")
    return value


def export_lines(env: Mapping[str, str]) -> list[str]:
    return [f"export {k}={job_value(v)}" for k, v in env.items()]


def exec_line(argv: list[str]) -> str:
    """``exec ARGV`` with each word quoted, but the port variable expanded."""
    return "exec " + " ".join(f'"{a}"' if a == PORT_SH else shlex.quote(a) for a in argv)


def mem_mb(text: str) -> int:
    """Slurm's ``--mem`` value (a number with an optional K/M/G/T unit; M by default) in MB."""
    unit = text[-1].upper() if text[-1].isalpha() else "M"
    number = text[:-1] if text[-1].isalpha() else text
    return round(float(number) * _MEM_UNITS[unit])


def sbatch_resources(script: str) -> dict[str, str]:
    """What a script's ``#SBATCH`` lines ask for, normalised (``--nodes`` and ``--ntasks``
    default to 1, memory in MB)."""
    found: dict[str, str] = {}
    for line in script.splitlines():
        m = _SBATCH.match(line.strip())
        if m and m.group(1) in RESOURCE_KEYS:
            found[m.group(1)] = m.group(2) or ""
    out = {"nodes": "1", "ntasks": "1", **found}
    if "mem" in out:
        out["mem"] = f"{mem_mb(out['mem'])}M"
    return {k: out[k] for k in RESOURCE_KEYS if k in out}


@dataclass(frozen=True)
class EngineCall:
    """How one contender's job starts vLLM: the model, its arguments, its environment."""

    model_path: str
    args: tuple[str, ...]
    env: Mapping[str, str]


def parity_problems(
    resources: Mapping[str, dict[str, str]], calls: Mapping[str, EngineCall]
) -> list[str]:
    """Where a contender's job differs from the first one's (the baseline): resources, vLLM's
    model, arguments or environment. Empty: the same job three ways."""
    problems: list[str] = []
    base_key = next(iter(resources))
    base_res, base_call = resources[base_key], calls[base_key]
    for key, res in resources.items():
        if res != base_res:
            problems.append(f"{key}: Slurm resources {res} != {base_key}'s {base_res}")
        call = calls[key]
        if call.model_path != base_call.model_path:
            problems.append(f"{key}: model {call.model_path} != {base_call.model_path}")
        if call.args != base_call.args:
            problems.append(f"{key}: vLLM arguments {call.args} != {base_call.args}")
        if dict(call.env) != dict(base_call.env):
            problems.append(f"{key}: engine environment {dict(call.env)} != {dict(base_call.env)}")
    return problems
