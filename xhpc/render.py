"""sbatch script rendering (pure): Jinja2 with StrictUndefined.

Two filters, one per kind of line. ``sb`` is for ``#SBATCH`` lines, which Slurm's own parser reads
(quoting does not protect them): it passes a value only when it is made of the characters every
``xhpc.sbatch_values`` kind allows, and never starts with ``-``; the parameter models below
already hold each field to its own kind, so ``sb`` is the second wall. ``q`` is for the script's
shell lines: ``shlex.quote``, refusing control characters.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from xhpc.sbatch_values import (
    AccountName,
    GpuType,
    HostList,
    JobPath,
    JobText,
    PartitionName,
    QosName,
    SlurmTime,
)

DEFAULT_TEMPLATES = Path(__file__).resolve().parent / "templates"
# Every character any kind of xhpc.sbatch_values allows: what ``sb`` lets onto an #SBATCH line.
_SBATCH_CHARS = re.compile(r"[A-Za-z0-9._,:@%+=/\[\]-]+")


# Slurm's time-limit warning (``--signal=B:USR1@N``) comes this long before a job's end: its
# agent drains then. Admission refuses time limits too short to serve past it.
SIGNAL_LEAD_S = 60


class SbatchParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    replica_id: str
    deployment: str
    job_name: JobText
    comment: JobText
    gpus: int = Field(ge=0)  # on each node
    gpu_type: GpuType | None = None
    partition: PartitionName | None = None
    account: AccountName | None = None
    time: SlurmTime
    nodelist: HostList | None = None
    # > 1: one engine across this many whole nodes (an agent per node, one srun step)
    nodes: int = Field(default=1, ge=1, le=64)
    exclusive: bool = False  # whole nodes (--exclusive)
    cpus: int = Field(default=1, ge=1)
    mem_mb: int | None = None
    output: JobPath
    agent_python: JobPath
    replica_dir: JobPath
    signal_lead_s: int = SIGNAL_LEAD_S
    pilot: bool = False  # the job is a pilot: its agent runs several replicas inside it

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        # A newline would end an #SBATCH line and start a shell command: refuse it (and any
        # other control character) rather than rely on quoting.
        if isinstance(value, str) and not value.isprintable():
            raise ValueError(f"{info.field_name} must not contain newlines or control characters")
        return value

    @property
    def gres(self) -> str:
        return f"gpu:{self.gpu_type}:{self.gpus}" if self.gpu_type else f"gpu:{self.gpus}"


def shape_options(params: SbatchParams) -> list[str]:
    """The options of ``serve.sbatch.j2`` that decide where and when the job can run (its size,
    time and account; not its node or partition), as sbatch arguments: what ``sbatch
    --test-only`` is asked about for a job of this shape."""
    tasks = ["--ntasks-per-node=1"] if params.nodes > 1 else ["--ntasks=1"]
    if params.exclusive:
        tasks.append("--exclusive")
    opts = [f"--nodes={params.nodes}", *tasks, f"--cpus-per-task={params.cpus}"]
    opts.append(f"--time={params.time}")
    if params.gpus > 0:
        opts.append(f"--gres={params.gres}")
    if params.account:
        opts.append(f"--account={params.account}")
    if params.mem_mb:
        opts.append(f"--mem={params.mem_mb}M")
    return opts


def _quote(value: object) -> str:
    text = str(value)
    if not text.isprintable():
        raise ValueError(f"refusing to render {text!r}: newlines and control characters")
    return shlex.quote(text)


def _sbatch(value: object) -> str:
    """A value for an ``#SBATCH`` line, as it is: refused unless every character is allowed."""
    text = str(value)
    if not _SBATCH_CHARS.fullmatch(text) or text.startswith("-"):
        raise ValueError(f"refusing to put {text[:80]!r} on an #SBATCH line")
    return text


def _environment(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["q"] = _quote
    env.filters["sb"] = _sbatch
    return env


def render_sbatch(
    params: SbatchParams, templates_dir: Path = DEFAULT_TEMPLATES, name: str = "serve.sbatch.j2"
) -> str:
    template = _environment(templates_dir).get_template(name)
    return template.render(**params.model_dump(), gres=params.gres)


class PdComponent(BaseModel):
    """One component of a PD unit's heterogeneous job: one prefill or decode instance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replica_id: str
    role: str
    gpus: int = Field(ge=1)
    gpu_type: GpuType | None = None
    nodelist: HostList | None = None
    # > 1: one engine across this many nodes (an agent per node, one srun step)
    nodes: int = Field(default=1, ge=1, le=64)
    exclusive: bool = False  # whole nodes (--exclusive)
    cpus: int = Field(default=1, ge=1)
    replica_dir: JobPath

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        return SbatchParams._one_line(value, info)

    @property
    def gres(self) -> str:
        return f"gpu:{self.gpu_type}:{self.gpus}" if self.gpu_type else f"gpu:{self.gpus}"


class PdSbatchParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    unit_id: str
    deployment: str
    job_name: JobText
    comment: JobText
    partition: PartitionName | None = None
    account: AccountName | None = None
    time: SlurmTime
    mem_mb: int | None = None
    output: JobPath
    agent_python: JobPath
    signal_lead_s: int = SIGNAL_LEAD_S
    components: tuple[PdComponent, ...] = Field(min_length=2)

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        return SbatchParams._one_line(value, info)


def render_pd_sbatch(params: PdSbatchParams, templates_dir: Path = DEFAULT_TEMPLATES) -> str:
    template = _environment(templates_dir).get_template("pd.sbatch.j2")
    fields = params.model_dump()
    fields["components"] = params.components  # objects, for their `gres`
    roles = " + ".join(c.role for c in params.components)
    return template.render(**fields, roles=roles)


class BatchSbatchParams(BaseModel):
    """A batch's job array: one task per shard (``xhpc/templates/batch.sbatch.j2``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_id: str
    job_name: JobText
    comment: JobText
    last_task: int = Field(ge=0)
    gpus: int = Field(ge=0)
    cpus: int = Field(default=1, ge=1)
    partition: PartitionName | None = None
    qos: QosName | None = None
    account: AccountName | None = None
    time: SlurmTime
    output: JobPath
    python: JobPath
    batch_dir: JobPath
    signal_lead_s: int = SIGNAL_LEAD_S

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        return SbatchParams._one_line(value, info)


def render_batch_sbatch(params: BatchSbatchParams, templates_dir: Path = DEFAULT_TEMPLATES) -> str:
    template = _environment(templates_dir).get_template("batch.sbatch.j2")
    return template.render(**params.model_dump())


class CacheSbatchParams(BaseModel):
    """A short job on one node that works on the weights cache (``cache.sbatch.j2``): removes
    node-local copies (``evict``) or fills the shared store (``pull``); no GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_name: JobText
    comment: JobText
    action: str = Field(pattern=r"^(evict|pull)$")
    args: tuple[str, ...] = ()
    partition: PartitionName | None = None
    account: AccountName | None = None
    time: SlurmTime = "00:30:00"
    nodelist: HostList | None = None
    output: JobPath
    agent_python: JobPath

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        for item in value if isinstance(value, tuple) else (value,):
            SbatchParams._one_line(item, info)
        return value


def render_cache_sbatch(params: CacheSbatchParams, templates_dir: Path = DEFAULT_TEMPLATES) -> str:
    template = _environment(templates_dir).get_template("cache.sbatch.j2")
    return template.render(**params.model_dump())
