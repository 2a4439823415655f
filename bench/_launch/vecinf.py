"""vec-inf 0.9.0 as the bench runs it: its directories under the run's work directory (the
cluster environment named by VEC_INF_CONFIG_DIR, logs, work dir), the round's model config
filled in from bench/_launch/vec_inf_models.yaml, the `vec-inf launch` command and the job id in
its JSON output, where the job's server listens (the port in the job's JSON, else in vLLM's log
line), and the script vec-inf would submit (bench/_launch/render_vec_inf.py, run with vec-inf's
interpreter) read back into the vLLM command it runs.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cluster import slurm_env
from .engine import NODE_ADDR_SH, EngineCall, VllmCommand, job_value
from .params import HERE, MODEL_DIR, VEC_INF_VENV, VLLM_VENV, Resources

MODELS_TEMPLATE = HERE / "vec_inf_models.yaml"
ENVIRONMENT = HERE / "vec_inf_environment.yaml"
RENDER = HERE / "render_vec_inf.py"
VEC_INF = VEC_INF_VENV / "bin" / "vec-inf"
VEC_INF_PY = VEC_INF_VENV / "bin" / "python"
FAMILY = "tiny-llama"  # the template's model_family
# Exported in vec-inf's job only, for the dev cluster (the template says why)
WORKAROUND_ENV = {"SLURMD_NODENAME": NODE_ADDR_SH}
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
_VLLM_LISTENS = re.compile(r"Starting vLLM server on \S+:(\d+)")


def vllm_args_mapping(args: tuple[str, ...]) -> dict[str, str | bool]:
    """Command-line arguments as vec-inf's ``vllm_args``: each ``--flag`` to the word after it,
    or to true when a flag (or nothing) follows."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if not flag.startswith("--"):
            raise ValueError(f"vLLM argument {flag!r} follows no flag")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[flag] = args[i + 1]
            i += 2
        else:
            out[flag] = True
            i += 1
    return out


def fill(template: str, values: Mapping[str, object]) -> str:
    """``template`` with each ``@KEY@`` replaced by the JSON of ``values[KEY]``; every
    placeholder must be given."""
    text = template
    for key, value in values.items():
        text = text.replace(f"@{key}@", json.dumps(value))
    left = sorted(set(_PLACEHOLDER.findall(text)))
    if left:
        raise ValueError(f"placeholders left unfilled: {', '.join(left)}")
    return text


@dataclass(frozen=True)
class VecInfDirs:
    """Everything vec-inf reads or writes for the run, under ``root``."""

    root: Path

    @property
    def config_dir(self) -> Path:
        return self.root / "config"  # VEC_INF_CONFIG_DIR: environment.yaml

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    def prepare(self) -> None:
        for d in (self.config_dir, self.log_dir, self.work_dir):
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(ENVIRONMENT, self.config_dir / "environment.yaml")

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """What every vec-inf command runs with: ``base``, SLURM_CONF, VEC_INF_CONFIG_DIR."""
        return {**slurm_env(base), "VEC_INF_CONFIG_DIR": str(self.config_dir)}

    def models_file(self, model: str) -> Path:
        return self.root / f"{model}.yaml"

    def job_file(self, model: str, job_id: str, suffix: str) -> Path:
        """The job's ``.out``, ``.err``, ``.json`` or ``.sbatch``."""
        name = f"{model}.{job_id}"
        return self.log_dir / FAMILY / name / f"{name}{suffix}"


def models_config(dirs: VecInfDirs, model: str, cmd: VllmCommand, res: Resources) -> str:
    """The round's model config: the template filled in."""
    env = {k: job_value(v) for k, v in {**cmd.env, **WORKAROUND_ENV}.items()}
    values: dict[str, object] = {
        "MODEL_NAME": model,
        "MODEL_PATH": str(MODEL_DIR),
        "WORK_DIR": str(dirs.work_dir),
        "VLLM_VENV": str(VLLM_VENV),
        "GPUS": res.gpus,
        "PARTITION": res.partition,
        "CPUS": res.cpus,
        "MEM": f"{res.mem_gb}G",
        "TIME": res.time,
        "LOG_DIR": str(dirs.log_dir),
        "VLLM_ARGS": vllm_args_mapping(cmd.args),
        "ENV": env,
    }
    return fill(MODELS_TEMPLATE.read_text(), values)


def write_models(dirs: VecInfDirs, model: str, cmd: VllmCommand, res: Resources) -> Path:
    path = dirs.models_file(model)
    path.write_text(models_config(dirs, model, cmd, res))
    return path


def launch_argv(model: str, config_file: Path) -> list[str]:
    return [str(VEC_INF), "launch", model, "--config", str(config_file), "--json-mode"]


def job_name(model: str) -> str:
    return f"{model}-vec-inf"


def launched_job_id(stdout: str) -> str | None:
    """The job id in `vec-inf launch --json-mode`'s output (its launch parameters, one line)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                job = json.loads(line).get("slurm_job_id")
            except ValueError:
                return None
            return str(job) if job else None
    return None


def _port_in_json(path: Path) -> int | None:
    """The port of ``server_address``, which the job merges into the JSON vec-inf wrote."""
    try:
        data: Any = json.loads(path.read_text())
        address = str(data["server_address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    port = address.rstrip("/").removesuffix("/v1").rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _port_in_log(*paths: Path) -> int | None:
    """The port in vLLM's ``Starting vLLM server on http://0.0.0.0:PORT`` line."""
    for path in paths:
        try:
            m = _VLLM_LISTENS.search(path.read_text(errors="replace"))
        except OSError:
            continue
        if m:
            return int(m.group(1))
    return None


def server_port(dirs: VecInfDirs, model: str, job_id: str) -> int | None:
    """Where the job's vLLM listens: the job's JSON, or (when vec-inf's own write of that file
    came after the job's and dropped the address) vLLM's log line."""
    port = _port_in_json(dirs.job_file(model, job_id, ".json"))
    if port is None:
        port = _port_in_log(
            dirs.job_file(model, job_id, ".out"), dirs.job_file(model, job_id, ".err")
        )
    return port


def render(dirs: VecInfDirs, model: str, config_file: Path, base: Mapping[str, str]) -> str:
    """The sbatch script vec-inf would submit for ``model`` (nothing submitted)."""
    proc = subprocess.run(
        [str(VEC_INF_PY), "-P", str(RENDER), model, "--config", str(config_file)],
        env=dirs.env(base), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"vec-inf could not build its job script:\n{proc.stderr[-2000:]}")
    return proc.stdout


def serve_words(script: str) -> list[str]:
    """The words of the script's `vllm serve ...` command (continued lines joined)."""
    joined = script.replace("\\\n", " ")
    for line in joined.splitlines():
        if line.strip().startswith("vllm serve "):
            return shlex.split(line)
    raise ValueError("no `vllm serve` command in vec-inf's script")


def exports(script: str) -> dict[str, str]:
    """The script's ``export K=V`` lines, as written."""
    out = {}
    for line in script.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = value
    return out


def engine_call(script: str) -> EngineCall:
    """How vec-inf's job starts vLLM: the model (the positional path), the arguments after
    ``--port``, the environment exported (its dev-cluster workaround left out)."""
    words = serve_words(script)
    args = tuple(words[words.index("--port") + 2 :])
    env = {k: v for k, v in exports(script).items() if k not in WORKAROUND_ENV}
    return EngineCall(model_path=words[2], args=args, env=env)
