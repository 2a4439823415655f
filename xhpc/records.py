"""The broker's records of deployments, jobs (pilots and PD units) and events, as typed values.

Each is the domain form of one store row (``xhpc.store`` converts a row once, where it is
read): states are enums, GPU indexes are tuples, argument lists are tuples and timestamps are
UTC-aware. Pure broker logic takes these, never rows. A replica's is ``ReplicaRecord``: its
``xhpc.models.ReplicaView`` and what only the broker reads.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from xhpc.models import (
    EngineKind,
    Frozen,
    JobKind,
    JobState,
    PilotState,
    ReplicaView,
    RestartPolicy,
    UnitState,
    check_name,
)


class DeploymentRecord(Frozen):
    """A deployment: what was served, and the desired state the broker keeps true."""

    name: str
    model: str
    model_path: str
    engine: EngineKind
    gpus: int
    partition: str | None = None
    time_limit: str | None = None
    nodelist: str | None = None  # a Slurm hostlist its replicas may run on
    engine_args: tuple[str, ...] = ()
    created_at: datetime  # when it was (last) served: its current serving starts here
    stopped_at: datetime | None = None  # when it ended (None: live)
    gpu_type: str | None = None
    pilot_node: str | None = None  # its replicas run in the pilot job on this node
    owner: str | None = None  # the Unix user who served it
    account: str | None = None  # the Slurm account its jobs are charged to
    pd: str | None = None  # "xPyD": its members are PD units
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    # The ServeRequest as served (JSON; None before it was stored), read back by
    # xhpc.broker.plan.desired.stored_request when more replicas are launched.
    request: str | None = None
    wanted: int = 0  # replicas (or PD units) to keep
    restart: RestartPolicy = RestartPolicy.ALWAYS
    until_at: datetime | None = None  # when it ends by itself (--for)
    failed_reason: str | None = None  # why the broker gave up on it
    sleeping: bool = False  # at 0 replicas by its scaling policy (not stopped): a call wakes it


class ReplicaRecord(ReplicaView):
    """A replica as the broker keeps it: its view and what only the broker reads (its agent's
    token digest, the secret its engine requires, its engine's ports and served name). These
    never leave in an answer: a record dumps as its view does (``view`` narrows it to one)."""

    served_model: str | None = Field(default=None, exclude=True)
    token_hash: str | None = Field(default=None, repr=False, exclude=True)
    engine_secret: str | None = Field(default=None, repr=False, exclude=True)
    side_channel_port: int | None = Field(default=None, exclude=True)
    max_model_len: int | None = Field(default=None, exclude=True)
    agent_port: int | None = Field(default=None, exclude=True)

    def view(self) -> ReplicaView:
        """The replica as the CLI and the proxy see it."""
        return ReplicaView.model_validate(
            {name: getattr(self, name) for name in ReplicaView.model_fields}
        )


class JobRunRecord(Frozen):
    """One run of a replica's own Slurm job, as Slurm last told of it: (replica_id, job_id,
    submitted_at) identifies it (Slurm's ids restart); ``ended_at`` once the replica left it."""

    id: int | None = None  # its place in the runs table (None: not written yet)
    job_id: str
    replica_id: str
    slurm_state: str
    reason: str | None = None
    node: str | None = None
    gres_detail: str | None = None
    script_path: str | None = None
    output_path: str | None = None
    submitted_at: datetime
    ended_at: datetime | None = None


class JobRecord(Frozen):
    """A Slurm job that hosts replicas, whatever its kind: one row of the jobs table. A pilot and
    a PD unit are views of it (``PilotRecord``, ``UnitRecord``) with their kind's names."""

    key: str  # the pilot's or the unit's id
    kind: JobKind
    deployment: str | None = None  # None: it serves several deployments (a pilot)
    index: int = 0
    spec: str = ""  # a PD unit's "xPyD"
    node: str | None = None  # the node it holds (a pilot)
    gpus: int = 0  # the GPUs it holds (a pilot)
    state: JobState
    job_id: str | None = None
    token_hash: str | None = Field(default=None, repr=False, exclude=True)
    job_dir: str | None = None
    output_path: str | None = None
    devices: tuple[int, ...] = ()  # GPU indexes the job can see, as its agent reports them
    reason: str | None = None
    last_heartbeat: datetime | None = None
    created_at: datetime
    updated_at: datetime


class PilotRecord(Frozen):
    """A pilot job: it holds GPUs on one node and runs several replicas inside."""

    pilot_id: str
    node: str
    gpus: int  # GPUs the job holds
    state: PilotState
    job_id: str | None = None
    token_hash: str = Field(repr=False, exclude=True)  # its agent's token, as a digest
    pilot_dir: str
    output_path: str | None = None
    devices: tuple[int, ...] = ()  # GPU indexes the job can see, as its agent reports them
    reason: str | None = None
    last_heartbeat: datetime | None = None
    created_at: datetime
    updated_at: datetime


class UnitRecord(Frozen):
    """A PD unit: one heterogeneous job holding its prefill and decode instances."""

    unit_id: str
    deployment: str
    index: int
    spec: str  # "xPyD"
    job_id: str | None = None  # the hetjob's leader id
    state: UnitState
    reason: str | None = None
    created_at: datetime
    updated_at: datetime


class EventRecord(Frozen):
    """One event the broker recorded: a replica's state change (``kind`` "state"), a pilot's or
    a PD unit's, a reservation released, a job adopted or re-planned. Oldest first by ``id``."""

    id: int
    at: datetime
    replica_id: str | None = None
    deployment: str | None = None
    kind: str
    message: str


class AdapterRecord(Frozen):
    """A LoRA adapter on a deployment: served by ``name`` on every READY replica of ``base``
    (loaded while the replica runs), owned by the user who added it."""

    name: str
    base: str
    path: str
    owner: str
    digest: str  # its directory's content digest, as the weights ledger names weights
    size_bytes: int = 0
    created_at: datetime
    # Which serving of ``base`` it was added to (the deployment's own created_at): a deployment
    # served again under that name later, by anyone, is another one, and the adapter goes.
    base_created_at: datetime


class AdapterView(AdapterRecord):
    """An adapter as `xhpc adapters list` shows it: and the READY replicas that hold it now,
    with the seconds from each one's READY to the adapter's load there (0: loaded before the
    replica was READY, as the broker does when its agent registers)."""

    loaded_on: tuple[str, ...] = ()
    load_s: dict[str, float] = Field(default_factory=dict)


class AdapterAdd(Frozen):
    """`xhpc adapters add NAME --base DEPLOYMENT --path DIR` (``POST /v1/adapters``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(max_length=64)
    base: str = Field(max_length=64)
    path: str = Field(max_length=4096)

    @field_validator("name", "base")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, "adapter name" if info.field_name == "name" else "deployment name")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("adapter path holds a NUL character")
        return v
