"""Typed domain models that cross module boundaries."""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xhpc.engine_config import ModelEngineConfig
from xhpc.sbatch_values import GpuType, HostList, PartitionName, SlurmTime

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_name(value: str, what: str = "name") -> str:
    """A name that may reach Slurm, a file path or a URL: letters, digits, '.', '_', '-'."""
    if not NAME_RE.fullmatch(value):
        shown = value if value.isprintable() and len(value) <= 80 else repr(value[:80])
        raise ValueError(
            f"invalid {what} {shown!s}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReplicaState(StrEnum):
    CREATING = "CREATING"
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    LOST = "LOST"


class EngineKind(StrEnum):
    VLLM = "vllm"
    TRANSFORMERS = "transformers"
    COMMAND = "command"


class RestartPolicy(StrEnum):
    """When a deployment's replicas are replaced: every end, unplanned ends only, never."""

    ALWAYS = "always"
    ON_FAILURE = "on-failure"
    NEVER = "never"


class PdRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class UnitState(StrEnum):
    """A PD unit's state, derived from its instances' (xhpc.broker.plan.units)."""

    STARTING = "STARTING"  # submitted or starting: not every instance is READY yet
    READY = "READY"  # every prefill and decode instance is READY: it takes traffic
    DEGRADED = "DEGRADED"  # an instance failed or was lost while the others live
    STOPPING = "STOPPING"
    ENDED = "ENDED"


DEFAULT_TARGET_IN_FLIGHT = 4.0  # per replica, when a scaling policy names no target


class ScalingPolicy(Frozen):
    """A deployment's scaling policy, kept in its desired state (`xhpc serve --min --max ...`):
    the broker decides its replica count from demand (xhpc.broker.plan.autoscale)."""

    min_replicas: int = Field(default=1, ge=0, le=256)
    max_replicas: int = Field(default=1, ge=1, le=256)
    target_in_flight: float | None = Field(default=None, gt=0, le=10_000)  # per replica
    ttft_s: float | None = Field(default=None, gt=0, le=3600)  # objective (p90)
    idle_s: float = Field(default=900.0, ge=10, le=7 * 86400)  # no request: down to the minimum
    down_window_s: float = Field(default=300.0, ge=10, le=86400)

    @model_validator(mode="after")
    def _bounds(self) -> ScalingPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min replicas ({self.min_replicas}) over max replicas ({self.max_replicas})"
            )
        return self

    @property
    def target(self) -> float:
        return self.target_in_flight or DEFAULT_TARGET_IN_FLIGHT

    def shown(self) -> str:
        """As `xhpc ps` shows it: ``auto 1..4``."""
        return f"auto {self.min_replicas}..{self.max_replicas}"


class ScalingChange(Frozen):
    """A change of a deployment's scaling policy in place (`xhpc scale NAME --min --max ...`):
    the knobs given; the others stay as the policy has them."""

    min_replicas: int | None = None
    max_replicas: int | None = None
    target_in_flight: float | None = None
    ttft_s: float | None = None
    idle_s: float | None = None
    down_window_s: float | None = None

    def over(self, current: ScalingPolicy | None) -> ScalingPolicy:
        """The policy with these knobs (checked whole); a fixed deployment needs a maximum."""
        given = self.model_dump(exclude_none=True)
        if not given:
            raise ValueError("no knob of the scaling policy given")
        if current is None and "max_replicas" not in given:
            raise ValueError("the deployment is not autoscaled: give max_replicas (--max)")
        base = current.model_dump() if current is not None else {}
        return ScalingPolicy.model_validate({**base, **given})


class ServeRequest(Frozen):
    """What `xhpc serve` asks for."""

    model: str
    name: str | None = None
    replicas: int = Field(default=1, ge=1, le=256)
    gpus: int = Field(default=1, ge=1, le=64)  # on each node
    # A replica spans this many nodes: one Slurm job, one engine whose ranks run on every node
    # (vLLM's own multi-node launch), ``gpus`` GPUs on each.
    nodes: int = Field(default=1, ge=1, le=64)
    engine: EngineKind | None = None
    partition: PartitionName | None = None
    time: SlurmTime | None = None
    nodelist: HostList | None = None
    engine_args: tuple[str, ...] = ()
    let_slurm_place: bool = False  # submit without a per-replica node choice
    # A deployment outlives its jobs: ``time`` is one job's limit; ``restart`` says when ended
    # replicas are replaced (None: the site's default); ``run_for`` ends the deployment after this
    # long (Slurm's [D-]HH:MM:SS form; None: until stopped).
    restart: RestartPolicy | None = None
    run_for: SlurmTime | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        # the rule the deployment's name is held to wherever it goes (check_name)
        return v if v is None else check_name(v, "deployment name")

    gpu_type: GpuType | None = None  # the GRES type every replica needs (`gpu:TYPE:K`)
    replica_configs: tuple[ReplicaConfig, ...] = ()  # one per replica, or none
    # Run the replicas inside a pilot job on this node: the one already there, or a new one
    # holding ``pilot_gpus`` GPUs (None: every GPU of the node).
    pilot: str | None = None
    pilot_gpus: int | None = Field(default=None, ge=1, le=1024)
    # Prefill/decode disaggregation: "xPyD" (e.g. "1P1D"); ``replicas`` then counts PD units,
    # each one heterogeneous job with x prefill and y decode instances.
    pd: str | None = Field(default=None, pattern=r"^[1-8]P[1-8]D$")
    prefill_gpus: int | None = Field(default=None, ge=1, le=64)  # None: --gpus
    decode_gpus: int | None = Field(default=None, ge=1, le=64)
    # A unit's prefill (decode) instances each span this many nodes (None: --nodes)
    prefill_nodes: int | None = Field(default=None, ge=1, le=64)
    decode_nodes: int | None = Field(default=None, ge=1, le=64)
    # How the engine serves the model (typed; from the catalog entry unless the request says)
    engine_config: ModelEngineConfig | None = None
    prefill_args: tuple[str, ...] = ()  # engine arguments for the prefill instances only
    decode_args: tuple[str, ...] = ()
    # The broker decides the replica count from demand, within the policy (None: ``replicas``).
    scaling: ScalingPolicy | None = None

    @model_validator(mode="after")
    def _replicas_within_scaling(self) -> ServeRequest:
        p = self.scaling
        if p is not None and not max(1, p.min_replicas) <= self.replicas <= p.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) must be within the scaling policy's "
                f"{max(1, p.min_replicas)}..{p.max_replicas}"
            )
        return self

    def pd_counts(self) -> tuple[int, int]:
        """(prefill, decode) instances per unit; (0, 0) for a plain deployment."""
        if self.pd is None:
            return (0, 0)
        p, d = self.pd[:-1].split("P")
        return int(p), int(d)

    @field_validator("pilot")
    @classmethod
    def _pilot(cls, v: str | None) -> str | None:
        return v if v is None else check_name(v, "node")


class ReplicaOutlook(Frozen):
    """What is coming for one active replica (``xhpc.broker.outlook.replica_outlook``): in
    `xhpc top`'s overview, and on each replica `xhpc ps` and `xhpc serve` get."""

    replica_id: str
    in_flight: int = 0  # requests in flight to it, over the proxies heard from lately
    # Slurm's reason for keeping its job pending (squeue's, e.g. Resources, Priority)
    pending_reason: str | None = None
    # Slurm's expected start of its pending job (squeue's start_time; set when the scheduler
    # has computed one)
    start_estimate: datetime | None = None
    # seconds until its running job's time limit, when the answer was made (None: no limit)
    time_left_s: float | None = None
    # when the keeper submits its walltime successor (its job's end less the handover lead);
    # None: no handover due (no time limit, --restart never, or a successor already runs)
    handover_at: datetime | None = None
    successor: str | None = None  # its successor, once submitted
    # a replica across nodes: its running job's nodes (squeue's hostlist, its head first)
    node_set: str | None = None
    # its engine's own figures at the broker's last scrape of its /metrics (vLLM: requests
    # running and waiting, KV-cache use from 0 to 1); None: not known (no recent scrape)
    engine_running: int | None = None
    engine_waiting: int | None = None
    kv_use: float | None = None

    def node_shown(self, node: str | None) -> str:
        """The node cell of ``xhpc ps``, ``serve`` and ``top``: the node set, else ``node``."""
        return self.node_set or node or "-"


class ReplicaView(Frozen):
    """A replica as the CLI and the proxy see it."""

    replica_id: str
    deployment: str
    index: int
    state: ReplicaState
    engine: EngineKind
    job_id: str | None = None
    node: str | None = None
    host: str | None = None
    port: int | None = None
    gpus: tuple[int, ...] = ()
    reason: str | None = None
    created_at: datetime
    updated_at: datetime
    role: PdRole | None = None  # PD instances: prefill or decode
    unit: str | None = None  # ... of this PD unit (one hetjob)
    pilot: str | None = None  # the pilot job it runs in
    restarts: int = 0  # the run of its (requeued) job its agents must belong to
    last_heartbeat: datetime | None = None
    ready_at: datetime | None = None
    ends_at: datetime | None = None  # its job's end (RUNNING jobs with a time limit)
    successor_of: str | None = None  # the replica it takes over from (walltime handover)
    placed_node: str | None = None  # the node xhpc chose (None: pinned by the user, or Slurm's)
    replans: int = 0  # times xhpc moved its pending job to another node
    # its spec, token and script (a pilot runs it from there); never in an API answer
    replica_dir: str | None = Field(default=None, exclude=True)
    pinned: tuple[int, ...] = ()  # GPU indexes asked for inside a pilot
    gpus_asked: int = 0  # the GPU count it asked for (0: not recorded)
    # what is coming for it (queue estimate, time left): set on the broker's answers about
    # active replicas (`GET /v1/replicas`, `/v1/deployments`), from its latest Slurm view
    outlook: ReplicaOutlook | None = None

    @property
    def endpoint(self) -> str | None:
        if self.host and self.port:
            return f"http://{self.host}:{self.port}"
        return None


class DeploymentView(Frozen):
    name: str
    model: str
    model_path: str
    engine: EngineKind
    gpus: int
    replicas: tuple[ReplicaView, ...] = ()
    wanted: int = 0  # replicas (or PD units) the broker keeps
    restart: RestartPolicy = RestartPolicy.ALWAYS
    stopped: bool = False
    failed_reason: str | None = None  # why the broker gave up on it (a crash loop)
    # Every proxy the broker hears from routes its READY replicas (``xhpc serve`` waits for it).
    routed: bool = True
    scaling: ScalingPolicy | None = None  # the broker decides ``wanted`` from demand


class Route(Frozen):
    """One READY replica the proxy may send a request to."""

    model: str
    replica_id: str
    url: str
    served_model: str
    secret: str | None = Field(default=None, repr=False)  # the engine requires it
    # Prefill/decode deployments: this instance's role and the PD unit (hetjob) it belongs to.
    # A model whose routes have roles is served by the two-phase route (xhpc.proxy.pd).
    role: PdRole | None = None
    unit: str | None = None
    max_model_len: int | None = None  # the engine's context length, when it states it
    # The agent's liveness port on the route's host (xhpc.agent.liveness): no answer there
    # after a broken connection means the whole job is gone, not just its engine.
    agent_port: int | None = None
    engine: EngineKind | None = None  # its engine (named in a 404 for a path it lacks)


# What a live agent's liveness port writes to each connection (xhpc.agent.liveness).
AGENT_GREETING = b"xhpc-agent alive\n"


class Waking(Frozen):
    """An autoscaled model's wake: whenever none of its routes serves (asleep, starting, or
    its routes lost) the gateway holds its calls until one does, or answers at once when it
    will not be in time."""

    since: datetime | None = None  # when its newest start was asked for (None: none starting)
    lead_s: float = Field(default=120.0, ge=0)  # how long a replica takes to serve (measured)
    failed: str | None = None  # why it cannot be woken now (held calls get this at once)
    # Asleep, a call is heard at a gateway's next sync and woken at the broker's next pass:
    # the broker's pass interval (the gateway adds its own sync interval).
    notice_s: float = Field(default=0.0, ge=0)

    def eta_s(self, now: datetime, sync_s: float = 0.0) -> float:
        """Seconds until a replica should serve: asleep, the time for the broker to hear of the
        call (``sync_s``: the gateway's sync interval, plus ``notice_s``) and the lead; waking,
        what is left of the lead since the wake began."""
        if self.since is None:
            return sync_s + self.notice_s + self.lead_s
        return max(1.0, self.lead_s - (now - self.since).total_seconds())


class RoutingTable(Frozen):
    version: int = 0
    models: tuple[str, ...] = ()
    routes: tuple[Route, ...] = ()
    parents: dict[str, str] = Field(default_factory=dict)  # a LoRA adapter -> its deployment
    waking: dict[str, Waking] = Field(default_factory=dict)  # each autoscaled model's wake
    # The sending broker's lease token (xhpc.store.lease): a gateway ignores a table of a lower
    # one while the higher one's broker answers (a former leader, frozen and resumed).
    epoch: int = Field(default=0, ge=0)


class AgentRegistration(Frozen):
    replica_id: str
    job_id: str
    node: str
    host: str
    port: int
    gpus: tuple[int, ...] = ()
    served_model: str
    side_channel_port: int | None = None  # a PD instance's KV side channel (NIXL)
    restarts: int = 0  # SLURM_RESTART_COUNT: which run of a requeued job this agent is
    max_model_len: int | None = Field(default=None, gt=0)  # the engine's, when it states it
    agent_port: int | None = Field(default=None, gt=0, lt=65536)  # xhpc.agent.liveness


class StagedCopy(Frozen):
    """A node-local copy of a model's weights that a job's agent staged (or found and checked)
    before its engine started (``xhpc.agent.staging``; the ledger: ``xhpc.weights``)."""

    model: str = Field(min_length=1, max_length=200)
    path: str = Field(min_length=1, max_length=4096)
    size_bytes: int = Field(ge=0)
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    reused: bool = False  # it was there already (another replica's, or an earlier run's)
    # The shared copy it was made from (a fresh copy: its digest is that copy's, as read).
    source: str | None = Field(default=None, min_length=1, max_length=4096)


class AgentReport(Frozen):
    """A heartbeat or a state report from the in-job agent."""

    replica_id: str
    job_id: str
    phase: str  # starting | ready | draining | stopping | stopped | failed
    detail: str | None = None
    restarts: int = 0  # SLURM_RESTART_COUNT of the job run this agent belongs to
    # where the job runs (staged reports); a failed replica across nodes: the node it lost
    node: str | None = Field(default=None, max_length=200)
    staged: StagedCopy | None = None  # the weights it staged on its node (phase "starting")


class NodeInfo(Frozen):
    """One node as `sinfo --json` reports it."""

    name: str
    address: str
    state: str
    state_flags: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    gpus_total: int = 0
    gpus_used: int = 0
    gpu_type: str | None = None
    gpus_used_idx: tuple[int, ...] = ()
    cpus: int = 0
    reason: str | None = None

    @property
    def usable(self) -> bool:
        bad = {"DOWN", "DRAIN", "DRAINING", "DRAINED", "NOT_RESPONDING", "FAIL", "INVALID"}
        return self.state.upper() not in bad and not (bad & {f.upper() for f in self.state_flags})


# Slurm job states in which a job holds its nodes' resources (and Slurm reports its GPU indexes)
HOLDING_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
    }
)


class JobInfo(msgspec.Struct, frozen=True, gc=False):
    """One job (or array task, or het component) as `squeue --json` reports it.

    A msgspec struct, not a pydantic model: the broker reads one per job of the whole cluster
    every poll (tens of thousands on a large site), built by ``xhpc.slurm.parse`` from values
    that already have these types, and never sends them over the API. Built from keywords, it
    checks nothing; ``msgspec.structs.replace`` makes a changed copy."""

    job_id: str
    raw_job_id: int
    name: str
    state: str
    reason: str | None = None
    user: str | None = None
    partition: str | None = None
    nodes: str | None = None
    batch_host: str | None = None
    comment: str | None = None
    gpus_idx: tuple[int, ...] = ()
    gres_detail: tuple[str, ...] = ()
    het_job_id: int | None = None
    het_job_offset: int | None = None
    array_job_id: int | None = None
    array_task_id: int | None = None
    time_limit_min: int | None = None
    start_time: datetime | None = None
    restart_count: int = 0  # how often Slurm requeued it (the job's SLURM_RESTART_COUNT)


class StartEstimate(Frozen):
    """When Slurm expects a job of a given shape to start, where (`sbatch --test-only`)."""

    start: datetime  # tz-aware UTC
    partition: str | None = None
    nodes: str | None = None  # Slurm's node list for it (a hostlist)
    processors: int = 0


class LogsView(Frozen):
    replica_id: str
    job_output: str
    engine_log: str


class AgentSpec(Frozen):
    """What the broker tells the in-job agent (written to the replica directory, owner-only)."""

    replica_id: str
    deployment: str
    engine: EngineKind
    model_path: str
    served_model: str
    python: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    cpu_only: bool = False
    startup_timeout_s: float = 600.0
    heartbeat_interval_s: float = 2.0
    broker_file: str
    # A PD instance: its role, its hetjob component (the job id it reports is "JOB+OFFSET"),
    # the KV-transfer config its engine gets, and whether it needs a NIXL side channel.
    pd_role: PdRole | None = None
    het_offset: int | None = None
    kv_transfer: dict[str, object] | None = None
    side_channel: bool = False
    # [cache] local_dir: the agent stages the weights there before the engine starts.
    stage_dir: str | None = None
    weights: str | None = None  # the weights cache's name for them (None: the deployment's)
    # The ledger's digest of the shared copy at model_path (None: not known yet): a node-local
    # copy is used only if its content has this digest.
    weights_digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    # A replica spanning nodes: one agent per node, each running its rank of one engine
    # (xhpc.agent.ranks); the engine gives up on a silent rank after ``execute_timeout_s``.
    nodes: int = Field(default=1, ge=1, le=64)
    execute_timeout_s: float | None = None


class GpuProcess(Frozen):
    """A process holding GPU memory, and the Slurm job it belongs to (None: no job = orphan)."""

    pid: int
    mem_used_mb: float | None = None
    job_id: str | None = None


class GpuProbe(Frozen):
    """One GPU as a node's probe sees it; fields the backend could not read are None."""

    index: int
    name: str | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    util_pct: float | None = None
    temp_c: float | None = None
    healthy: bool = True
    error: str | None = None
    processes: tuple[GpuProcess, ...] = ()


class ProbeReport(Frozen):
    """What `xhpc probe` reports for one node."""

    node: str
    taken_at: datetime
    backend: str  # "nvml" | "fake"
    gpus: tuple[GpuProbe, ...] = ()
    cpu_pct: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    errors: tuple[str, ...] = ()


class Reservation(Frozen):
    """GPUs promised to a replica between the placement decision and Slurm's allocation."""

    replica_id: str
    node: str
    gpus: int  # on each node
    created_at: datetime
    also: tuple[str, ...] = ()  # a replica across nodes: the other nodes of its set

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the reservation holds ``gpus`` GPUs on, its head first."""
        return (self.node, *self.also)


MAX_ROUTE_WAIT_S = 30.0


class ProxyLoad(Frozen):
    """What a proxy tells the broker when it fetches routes: the table it holds and its load."""

    proxy_id: str
    table_version: int
    outstanding: dict[str, int] = Field(default_factory=dict)
    # replicas this proxy could not connect to since its last sync (refused, timed out)
    unreachable: tuple[str, ...] = ()
    # Per model, counted since this proxy worker started: requests sent to a replica, and
    # requests for a listed model that had no replica to take them (asleep, starting).
    begun: dict[str, int] = Field(default_factory=dict)
    unserved: dict[str, int] = Field(default_factory=dict)
    held: dict[str, int] = Field(default_factory=dict)  # calls it holds for a replica, now
    # Seconds the broker may hold the answer while the table is still ``table_version``: it
    # answers the moment the table changes (routes pushed at once), else after this long.
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_ROUTE_WAIT_S)


class ScaleResult(Frozen):
    """What `xhpc scale` changed: replicas added, replicas drained for removal."""

    deployment: str
    previous: int
    target: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class ReplicaConfig(Frozen):
    """One replica's own target inside a request; None: the request's value (or xhpc's choice).

    ``gpu_idx`` pins GPU indexes on the node; they only make sense inside a pilot allocation.
    """

    node: str | None = None
    gpus: int | None = Field(default=None, ge=1, le=64)
    gpu_type: str | None = None
    gpu_idx: tuple[int, ...] = ()

    @field_validator("node", "gpu_type")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return v if v is None else check_name(v, "node or GPU type")

    @field_validator("gpu_idx")
    @classmethod
    def _indexes(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 or i > 1023 for i in v):
            raise ValueError(f"GPU indexes must be 0..1023, got {v}")
        return v


class PartitionInfo(Frozen):
    """One partition as `scontrol show partition` reports it (limits admission checks)."""

    name: str
    state: str = "UP"
    default: bool = False
    nodes: str | None = None  # a Slurm hostlist, e.g. "n[1-3]"
    max_time_min: int | None = None  # None: UNLIMITED
    default_time_min: int | None = None  # None: not set (jobs get MaxTime)
    allow_accounts: tuple[str, ...] | None = None  # None: ALL
    deny_accounts: tuple[str, ...] = ()
    allow_qos: tuple[str, ...] | None = None  # None: ALL
    deny_qos: tuple[str, ...] = ()


class JobKind(StrEnum):
    """The shape of a Slurm job xhpc submits: how many replicas it hosts and how."""

    REPLICA = "replica"  # one job, one replica
    PILOT = "pilot"  # one job holds a node's GPUs; its agent runs the replicas it is given
    UNIT = "unit"  # one heterogeneous job, one component per instance (prefill, then decode)


class JobState(StrEnum):
    """The state of a job that hosts replicas: one machine for every kind (xhpc.states). Each
    kind lives in some of the live states (a pilot: PENDING, RUNNING; a PD unit: STARTING,
    READY, DEGRADED, which sum up its instances'), and every kind ends through STOPPING/ENDED."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STARTING = "STARTING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    STOPPING = "STOPPING"
    ENDED = "ENDED"


class PilotState(StrEnum):
    PENDING = "PENDING"  # submitted, Slurm has not started it
    RUNNING = "RUNNING"  # its agent reports
    STOPPING = "STOPPING"  # cancelled by xhpc (no replica left), waiting for the job to end
    ENDED = "ENDED"


class PilotSpec(Frozen):
    """What a pilot job's agent reads from its (owner-only) directory."""

    pilot_id: str
    node: str
    gpu_sharing: bool = False
    poll_interval_s: float = 1.0
    broker_file: str


class PilotReport(Frozen):
    """A pilot agent's heartbeat: the devices its job can see and what runs on them."""

    pilot_id: str
    job_id: str
    node: str
    devices: tuple[int, ...] = ()
    running: dict[str, tuple[int, ...]] = Field(default_factory=dict)  # replica -> its GPUs


class PilotAssignment(Frozen):
    replica_id: str
    replica_dir: str
    gpus: int
    gpu_idx: tuple[int, ...] = ()  # pinned indexes (validated against the job's devices)


class PilotOrders(Frozen):
    """The broker's answer to a heartbeat: the replicas that should run, those to stop."""

    run: tuple[PilotAssignment, ...] = ()
    stop: tuple[str, ...] = ()


class PilotView(Frozen):
    pilot_id: str
    node: str
    gpus: int
    state: PilotState
    job_id: str | None = None
    devices: tuple[int, ...] = ()
    replicas: tuple[str, ...] = ()
