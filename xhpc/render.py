"""sbatch script rendering (pure): Jinja2 with StrictUndefined, every value shell-quoted."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_TEMPLATES = Path(__file__).resolve().parent.parent / "sbatch-templates"


# Slurm's time-limit warning (``--signal=B:USR1@N``) comes this long before a job's end: its
# agent drains then. Admission refuses time limits too short to serve past it.
SIGNAL_LEAD_S = 60


class SbatchParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    replica_id: str
    deployment: str
    job_name: str
    comment: str
    gpus: int = Field(ge=0)
    gpu_type: str | None = None
    partition: str | None = None
    account: str | None = None
    time: str
    nodelist: str | None = None
    cpus: int = Field(default=1, ge=1)
    mem_mb: int | None = None
    output: str
    agent_python: str
    replica_dir: str
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
    opts = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={params.cpus}", f"--time={params.time}"]
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


def _environment(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["q"] = _quote
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
    gpu_type: str | None = None
    nodelist: str | None = None
    cpus: int = Field(default=1, ge=1)
    replica_dir: str

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
    job_name: str
    comment: str
    partition: str | None = None
    account: str | None = None
    time: str
    mem_mb: int | None = None
    output: str
    agent_python: str
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
    """A batch's job array: one task per shard (``sbatch-templates/batch.sbatch.j2``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_id: str
    job_name: str
    comment: str
    last_task: int = Field(ge=0)
    gpus: int = Field(ge=0)
    cpus: int = Field(default=1, ge=1)
    partition: str | None = None
    qos: str | None = None
    time: str
    output: str
    python: str
    batch_dir: str
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

    job_name: str
    comment: str
    action: str = Field(pattern=r"^(evict|pull)$")
    args: tuple[str, ...] = ()
    partition: str | None = None
    account: str | None = None
    time: str = "00:30:00"
    nodelist: str | None = None
    output: str
    agent_python: str

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: object, info: ValidationInfo) -> object:
        for item in value if isinstance(value, tuple) else (value,):
            SbatchParams._one_line(item, info)
        return value


def render_cache_sbatch(params: CacheSbatchParams, templates_dir: Path = DEFAULT_TEMPLATES) -> str:
    template = _environment(templates_dir).get_template("cache.sbatch.j2")
    return template.render(**params.model_dump())
