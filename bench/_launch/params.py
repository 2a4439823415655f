"""The launch benchmark's fixed figures: where the model, the engine venvs and vec-inf live, how
often the one poll loop looks (squeue, the server), how long a run may take, the contenders (the
baseline first) and the phases, the Slurm resources every job asks for, the target, and its log
line.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._common import ROOT, logger

HERE = ROOT / "bench" / "_launch"
MODEL = "tiny-llama"  # xhpc's catalog name (xhpc/data/defaults.toml)
MODEL_DIR = ROOT / "models" / "tiny-llama"
SITE = ROOT / "site-configs" / "dev-cluster.toml"
VLLM_VENV = ROOT / ".venvs" / "vllm"
VEC_INF_VENV = ROOT / ".venvs" / "vec-inf"
VEC_INF_VERSION = "0.9.0"

POLL_S = 0.05  # one tick of the poll loop: squeue until RUNNING, then the server
LIVENESS_S = 1.0  # after RUNNING, squeue every this long: a job that ended fails its run
TIMEOUT_S = 600.0  # launch -> first answer, per run
GONE_TIMEOUT_S = 120.0  # a stopped job out of squeue
ROUNDS = 3
TARGET_XHPC_VS_PLAIN_S = 0.5

KEYS = ("plain", "vec-inf", "xhpc")  # the baseline first
LABELS = {"plain": "plain sbatch", "vec-inf": "vec-inf launch", "xhpc": "xhpc serve"}
PHASES = ("submit_s", "running_s", "first_200_s")
PHASE_LABELS = {
    "submit_s": "launch command returned",
    "running_s": "job RUNNING seen (squeue)",
    "first_200_s": "first 200 (launch -> first answer)",
}


@dataclass(frozen=True)
class Resources:
    """What every contender's job asks Slurm for (xhpc's dev site: 1 CPU a replica)."""

    partition: str = "gpu"
    gpus: int = 1
    cpus: int = 1
    mem_gb: int = 4  # vec-inf writes memory only as whole GB (``--mem=4G``)
    time: str = "00:30:00"

    @property
    def mem_mb(self) -> int:
        return self.mem_gb * 1024


RESOURCES = Resources()

log = logger("launch")
