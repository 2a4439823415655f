"""How each engine is started (pure): argv and a clean environment for a spec and a port."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xhpc.errors import EngineError
from xhpc.models import AgentSpec, EngineKind

# Variables passed from the job's environment to the engine; everything else is dropped.
PASS_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_JOB_ID",
    "SLURM_JOB_GPUS",
    "SLURM_PROCID",
)


def checks_keys(engine: EngineKind) -> bool:
    """Does the engine refuse requests without the replica's secret by itself?"""
    return engine is EngineKind.VLLM


class Rank(BaseModel):
    """This node's place in an engine that spans nodes (vLLM's ``mp`` multi-node launch): rank
    0 serves the API; the others run ``--headless``. ``interface``: the network interface of
    the node's address, which gloo must use (without it, it may pick loopback)."""

    model_config = ConfigDict(frozen=True)

    rank: int
    nodes: int
    master_addr: str
    master_port: int
    interface: str | None = None

    @property
    def head(self) -> bool:
        return self.rank == 0


# vLLM's CPU model runner skips its warm-up under --enforce-eager, which leaves a pipeline rank
# > 0 without its buffers (the first request fails); Dynamo's eager backend warms up and works.
CPU_PIPELINE_COMPILATION = json.dumps({"mode": 2, "backend": "eager"})


def _rank_args(spec: AgentSpec, args: tuple[str, ...]) -> tuple[str, ...]:
    """The site's and the deployment's engine arguments for one rank: on CPU, --enforce-eager
    becomes the eager compilation backend (pipeline ranks need its warm-up)."""
    if spec.cpu_only and "--enforce-eager" in args:
        args = tuple(a for a in args if a != "--enforce-eager")
        args = (*args, "--compilation-config", CPU_PIPELINE_COMPILATION)
    return args


class EngineLaunch(BaseModel):
    model_config = ConfigDict(frozen=True)

    argv: tuple[str, ...]
    env: dict[str, str]
    served_model: str


def _fill(template: str, values: Mapping[str, str]) -> str:
    try:
        return template.format_map(values)
    except (KeyError, ValueError) as err:
        raise EngineError(f"bad placeholder in engine command {template!r}: {err}") from err


def _python(spec: AgentSpec) -> str:
    return spec.python or "python3"


def _path_from_cwd(argv: list[str]) -> bool:
    """Is this ``python [-FLAGS] -m MODULE`` or ``-c CODE``? Python then puts the working
    directory first on ``sys.path``, ahead of the installed packages."""
    for part in argv[1:]:
        if not part.startswith("-"):
            return False
        if part[:2] in ("-m", "-c"):
            return True
    return False


def engine_launch(
    spec: AgentSpec,
    *,
    host: str,
    port: int,
    node_address: str,
    tmp_dir: Path,
    job_env: Mapping[str, str] | None = None,
    api_key: str | None = None,
    side_channel_port: int | None = None,
    rank: Rank | None = None,
) -> EngineLaunch:
    """The engine's command line and environment. ``api_key``: the replica's secret, which
    engines that check keys themselves (vLLM) get in their environment, never in argv.
    ``rank``: this node's rank of an engine spanning nodes (vLLM only)."""
    job_env = os.environ if job_env is None else job_env
    env = {k: job_env[k] for k in PASS_ENV if k in job_env}
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if spec.cpu_only:
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
    served = spec.served_model
    if spec.engine is EngineKind.VLLM:
        env.update(
            VLLM_HOST_IP=node_address,
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(tmp_dir / "vllm-cache"),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
        if api_key:
            env["VLLM_API_KEY"] = api_key
        if spec.kv_transfer is not None:
            # A PD instance: its role's connector config, and (NIXL) its KV side channel on the
            # node's address, where the other role's instances reach it.
            argv_kv = ["--kv-transfer-config", json.dumps(spec.kv_transfer, sort_keys=True)]
        else:
            argv_kv = []
        if side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = node_address
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        if rank is None:
            argv = [
                _python(spec),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                spec.model_path,
                "--served-model-name",
                served,
                "--host",
                host,
                "--port",
                str(port),
                *argv_kv,
            ]
        else:
            argv = [*_rank_argv(spec, rank, host, port, env), *argv_kv]
    elif spec.engine is EngineKind.TRANSFORMERS:
        # `transformers serve` names a model by the path string it was given.
        served = spec.model_path
        bin_dir = Path(_python(spec)).parent
        argv = [
            str(bin_dir / "transformers"),
            "serve",
            spec.model_path,
            "--host",
            host,
            "--port",
            str(port),
        ]
    else:
        if not spec.command:
            raise EngineError("the command engine needs `command` in its engine config")
        values = {
            "host": host,
            "port": str(port),
            "model_path": spec.model_path,
            "served_model": served,
            "python": _python(spec),
        }
        argv = [_fill(part, values) for part in spec.command]
    if _path_from_cwd(argv):
        # Python >= 3.11 (-P): never import from the working directory. The agent's is a
        # private empty directory anyway; this also covers a command that changes directory.
        env["PYTHONSAFEPATH"] = "1"
    env.update(spec.env)
    if api_key and spec.engine is EngineKind.VLLM:
        env["VLLM_API_KEY"] = api_key  # a site's engine env never replaces the replica's secret
    args = spec.args if rank is None else _rank_args(spec, spec.args)
    return EngineLaunch(argv=(*argv, *args), env=env, served_model=served)


def _rank_argv(spec: AgentSpec, rank: Rank, host: str, port: int, env: dict[str, str]) -> list[str]:
    """vLLM's own multi-node launch (``vllm serve``: the API server's module has no
    ``--headless``): every rank names the group's size, its own rank and rank 0's rendezvous
    store; rank 0 serves the API, the others serve none. xhpc sets these flags, never a
    deployment."""
    if spec.execute_timeout_s is not None:
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(max(1, round(spec.execute_timeout_s)))
    if rank.interface:
        env["GLOO_SOCKET_IFNAME"] = rank.interface
    if spec.cpu_only:
        # vLLM's CPU backend pins each worker's threads to cores it picks from the machine's
        # NUMA layout, not from the job's own CPUs: every rank of every job on a node takes the
        # same core. The job's CPU set is Slurm's to give (a site's engine env may say more).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    argv = [
        _python(spec),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        spec.model_path,
        "--served-model-name",
        spec.served_model,
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        str(rank.nodes),
        "--node-rank",
        str(rank.rank),
        "--master-addr",
        rank.master_addr,
        "--master-port",
        str(rank.master_port),
    ]
    if rank.head:
        return [*argv, "--host", host, "--port", str(port)]
    return [*argv, "--headless"]
