"""Configuration models (foundation): what a site, a user or the command line may set.

The base of every section and the gateway's `[proxy]` are in xhpc.gateway_settings (re-exported
here). Loaded only by xhpc.config (the one reader of config files and XHPC_* variables).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from xhpc.engine_config import ModelEngineConfig
from xhpc.gateway_settings import (
    BODY_LIMITS,
    ProxyConfig,
    RoutingPolicyName,
    Section,
    split_host_port,
)
from xhpc.models import EngineKind
from xhpc.sbatch_values import AccountName, PartitionName, QosName, SlurmTime

__all__ = [
    "BODY_LIMITS",
    "BackendKind",
    "BrokerConfig",
    "EngineConfig",
    "LifecycleConfig",
    "ModelEntry",
    "MultiNodeConfig",
    "OrphanPolicy",
    "PdConfig",
    "PlacementConfig",
    "PolicyConfig",
    "ProbeSettings",
    "ProxyConfig",
    "RoutingPolicyName",
    "Section",
    "SlurmConfig",
    "XhpcConfig",
    "split_host_port",
]


class SlurmConfig(Section):
    """How xhpc calls Slurm and what its jobs ask for (`[slurm]`)."""

    conf_path: Path | None = Field(
        default=None,
        description="Exported as SLURM_CONF to every Slurm command (unset: Slurm's own).",
    )
    bin_dir: Path | None = Field(
        default=None, description="Where sbatch, squeue, sinfo, ... are (unset: found on PATH)."
    )
    partition: PartitionName | None = Field(
        default=None, description="The partition jobs go to (unset: Slurm's default partition)."
    )
    default_time: SlurmTime = Field(
        default="01:00:00", description="A job's time limit when `serve` has no `--time`."
    )
    account: AccountName | None = Field(
        default=None,
        description="The Slurm account jobs are charged to (unset: the user's default).",
    )
    command_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A Slurm command running longer is killed (it may have acted).",
    )
    cpus_per_replica: int = Field(default=1, ge=1, description="CPUs each replica's job asks for.")
    mem_per_replica_mb: int | None = Field(
        default=None,
        gt=0,
        description="Memory each replica's job asks for (unset: the partition's default).",
    )


class PolicyConfig(Section):
    """The site's caps on every job xhpc submits, whichever door asked (`[policy]`): serve,
    scale, pilots, PD units, batches, cache pulls."""

    max_gpus: int | None = Field(
        default=None,
        ge=1,
        description="GPUs one job may ask for (a replica, a pilot, a PD component, a batch "
        "task; unset: no cap beyond the largest node).",
    )
    max_time: SlurmTime | None = Field(
        default=None,
        description="The longest time limit one job may ask for, in Slurm's form (unset: "
        "only the partitions' MaxTime; set, UNLIMITED is refused).",
    )
    max_shards: int = Field(
        default=100, ge=1, description="Array tasks (shards) one batch may ask for."
    )
    partitions: dict[str, list[PartitionName]] = Field(
        default_factory=dict,
        description='Per Slurm account, the partitions its jobs may use; `"*"`: every '
        "account not named (unset: any partition).",
    )
    qos: dict[str, list[QosName]] = Field(
        default_factory=dict,
        description='Per Slurm account, the QoS its jobs may ask for; `"*"`: every account '
        "not named (unset: any QoS).",
    )


class BrokerConfig(Section):
    """The broker (`[broker]`): its agent API, reconcile loop and who may call it."""

    agent_bind: str = Field(
        default="0.0.0.0", description="The address the agent API (TCP, for jobs and probes) binds."
    )
    agent_port: int = Field(
        default=0, ge=0, le=65535, description="The agent API's port (0: any free port)."
    )
    advertise_host: str | None = Field(
        default=None,
        description="The address compute nodes use to reach the broker (unset: `agent_bind`, "
        "or this host's fully qualified name when that is 0.0.0.0).",
    )
    reconcile_interval_s: float = Field(
        default=1.0, gt=0, description="How often the broker maps `squeue` onto its replicas."
    )
    heartbeat_interval_s: float = Field(
        default=2.0, gt=0, description="How often an agent reports to the broker."
    )
    lease_s: float = Field(
        default=6.0,
        ge=2,
        le=300,
        description="The leading broker's lease on the state, renewed every third of it: a "
        "standby (`xhpc broker --standby`) takes over this long after the leader stops "
        "renewing it (at once after a clean stop), and a former leader is fenced.",
    )
    heartbeat_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="A READY replica silent this long while its job runs is LOST.",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="A draining replica's job is cancelled after this at most (0: at once).",
    )
    pilot_poll_s: float = Field(
        default=1.0, gt=0, description="How often a pilot job's agent asks the broker for orders."
    )
    id: str | None = Field(
        default=None,
        description="Tags this broker's jobs (`--comment`); unset: one made once per state "
        "directory.",
    )
    admins: list[str] = Field(
        default_factory=list,
        description="Unix users who act on every model, manage keys and fix orphans.",
    )
    shared_socket: bool = Field(
        default=False,
        description="Every local user may reach the control socket (0666): a lab broker, which "
        "checks each call against its access table.",
    )
    socket_group: str | None = Field(
        default=None,
        description="A group whose members may reach the control socket (socket 0660, state "
        "directory 0710, both of this group): a member's broker shares it with the lab "
        "gateway's user. Without `shared_socket`, only the broker's own user, root, `admins` and "
        "`proxy_users` are answered (liveness aside): never another member of the group.",
    )
    proxy_users: list[str] = Field(
        default_factory=list,
        description="Unix users who may act as the proxy (routes with engine secrets, key digests, "
        "usage reports); the broker's own user and root always may.",
    )
    remote_control: bool = Field(
        default=True,
        description="Jobs of this user reach the control API over TCP (on `agent_bind`) with the "
        "state directory's control.token (0600), without admin or proxy rights: the Python API "
        "inside sbatch scripts. Off: only the unix socket.",
    )
    remote_control_port: int = Field(
        default=0, ge=0, le=65535, description="The TCP control API's port (0: any free port)."
    )
    batch_input_max_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1,
        description="The largest batch input the broker takes (bytes; `POST /v1/batch-inputs`, "
        "streamed to a file; every other control call's body is 1 MiB at most).",
    )
    batch_input_max_lines: int = Field(
        default=100_000, ge=1, description="The most requests (lines) a batch input may hold."
    )


class CacheConfig(Section):
    """The weights cache (`[cache]`): node-local copies of the shared store's models."""

    local_dir: Path | None = Field(
        default=None,
        description="A directory on each compute node's local disk where jobs stage weights "
        "before their engine starts (`<local_dir>/<user>/<model>`; a lock and an atomic rename "
        "make replicas on one node share one copy). It and the directories above it must be "
        "root's (or the user's), sticky where others may write them, like /tmp; a `<user>` "
        "directory that is not the user's own is refused and the engine loads the shared copy. "
        "Unset: engines load from the shared store.",
    )


class LifecycleConfig(Section):
    """How deployments outlive their jobs (`[lifecycle]`); see docs/lifecycle.md."""

    restart: Literal["always", "on-failure", "never"] = Field(
        default="always", description="The site's restart policy when `serve` has no `--restart`."
    )
    backoff_s: float = Field(
        default=5.0, ge=0, description="The wait before the first replacement after a failure."
    )
    backoff_max_s: float = Field(
        default=300.0, ge=0, description="The wait doubles after each failure up to this."
    )
    crash_loop_starts: int = Field(
        default=3,
        ge=1,
        description="This many failed starts within the window: the deployment is FAILED.",
    )
    crash_loop_window_s: float = Field(
        default=600.0, gt=0, description="The window failed starts are counted in."
    )
    node_cooldown_s: float = Field(
        default=600.0, ge=0, description="A node that failed a replica is avoided this long."
    )
    lost_grace_s: float = Field(
        default=60.0, ge=0, description="A LOST replica is replaced after this."
    )
    restart_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="After a broker start, heartbeats are not judged for this long.",
    )
    handover_floor_s: float = Field(
        default=120.0,
        ge=0,
        description="Walltime handover: a successor is submitted at least this long before a "
        "job's end; the lead grows to cover the deployment's measured queue wait and engine start.",
    )
    handover_margin: float = Field(
        default=1.5,
        ge=1,
        description="The measured queue wait and engine start are multiplied by this.",
    )


BackendKind = Literal["auto", "nvml", "fake"]


class AutoscaleConfig(Section):
    """Deployments served with a scaling policy (`[autoscale]`, `xhpc serve --min --max`): the
    broker decides their replica count from demand (docs/lifecycle.md)."""

    max_replicas: int | None = Field(
        default=None,
        ge=1,
        description="The most replicas the broker scales one deployment to, whatever its "
        "policy's --max (unset: the policy's).",
    )
    default_lead_s: float = Field(
        default=120.0,
        gt=0,
        description="A new replica's expected queue wait and engine start before one was "
        "measured (then: its deployment's slowest recent start).",
    )
    smooth_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="The recent load a deployment is scaled up on is its mean over this many "
        "seconds.",
    )
    trend_min_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="The load's trend is fitted over this many seconds at least (and over the "
        "lead); a shorter window follows steeper ramps and more noise.",
    )
    pilot_warm_s: float = Field(
        default=0.0,
        ge=0,
        le=7 * 86400,
        description="A pilot job left with no replica because an autoscaled deployment pinned "
        "to its node (`--pilot NODE`) went to sleep stays up this long: that deployment's wake "
        "starts in it, with no queue wait. 0: an empty pilot is cancelled at once.",
    )


class ProbeSettings(Section):
    """The node probe (`xhpc probe`, `[probe]`)."""

    backend: BackendKind = Field(
        default="auto", description="auto: NVML when the driver answers, else the fake backend."
    )
    interval_s: float = Field(default=5.0, gt=0, description="How often the node is sampled.")
    post_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a report's POST to the broker may take."
    )
    fake_file: Path | None = Field(
        default=None, description="TOML or JSON describing fake GPUs; read again at every sample."
    )
    fake_gpus: int = Field(
        default=0, ge=0, le=1024, description="Idle fake GPUs when there is no `fake_file`."
    )
    proc_root: Path = Field(
        default=Path("/proc"),
        description="Where GPU processes are looked up to find their Slurm jobs.",
    )
    broker_file: Path | None = Field(
        default=None, description="The broker's address file (unset: `<state_dir>/broker.json`)."
    )
    token_file: Path | None = Field(
        default=None,
        description="The node token presented to the broker (unset: `<state_dir>/probe.token`).",
    )


class OrphanPolicy(Section):
    """What `xhpc doctor --fix` does per kind of orphan (the `[orphans]` section). GPU processes
    with no Slurm job are only ever reported: xhpc never kills processes it did not start."""

    gpu_process: Literal["report"] = Field(
        default="report", description="A GPU process with no Slurm job: reported only."
    )
    job_without_replica: Literal["report", "cancel", "adopt"] = Field(
        default="report", description="A job tagged by this broker that no replica records."
    )
    replica_without_job: Literal["report", "mark-lost"] = Field(
        default="mark-lost", description="A live replica whose job Slurm no longer has."
    )


class PlacementConfig(Section):
    """How xhpc picks a node per replica (`[placement]`)."""

    strategy: str = Field(
        default="idle-first", description='"idle-first" (spread) or "pack" (fill nodes first).'
    )
    reservation_timeout_s: float = Field(
        default=300.0, gt=0, description="A GPU reservation still pending after this is released."
    )
    probe_ttl_s: float = Field(
        default=30.0, gt=0, description="Probe reports older than this stop counting."
    )
    max_view_age_s: float = Field(
        default=2.0,
        ge=0,
        description="How old a shared sinfo/squeue view `serve` may use (0: always fresh).",
    )
    gpu_sharing: bool = Field(
        default=False, description="May two replicas be pinned to the same GPU?"
    )
    replan_after_s: float = Field(
        default=120.0, gt=0, description="A replica pending this long on xhpc's node choice moves."
    )
    max_replans: int = Field(default=3, ge=0, description="Moves per replica at most.")
    estimate_candidates: int = Field(
        default=4,
        ge=0,
        le=64,
        description="When no node has the GPUs free: nodes to ask Slurm's start estimate for "
        "(`sbatch --test-only`, together) before queueing on the earliest (0: let Slurm choose).",
    )
    estimate_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="How long serve waits for those estimates; those not back by then are skipped.",
    )


class PdConfig(Section):
    """Prefill/decode disaggregation (`[pd]`): the vLLM KV connector every PD unit uses."""

    connector: str = Field(
        default="NixlConnector",
        description='The vLLM KV connector: "NixlConnector", or "ExampleConnector" (files in a '
        "shared directory).",
    )
    kv_buffer_device: str | None = Field(
        default=None, description="NIXL's KV buffer: \"cpu\" on CPU sites (unset: vLLM's default)."
    )
    extra_config: dict[str, str] = Field(
        default_factory=dict,
        description="Extra `kv_connector_extra_config`; {unit_dir} is replaced by the unit's own "
        "shared directory (ExampleConnector's shared_storage_path).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for PD engines (e.g. UCX_TLS for NIXL over TCP).",
    )
    prefill_args: list[str] = Field(
        default_factory=list, description="The site's engine arguments for prefill instances."
    )
    decode_args: list[str] = Field(
        default_factory=list, description="The site's engine arguments for decode instances."
    )
    prefill_nodes: str | None = Field(
        default=None, description="A Slurm hostlist prefill instances may run on (unset: any)."
    )
    decode_nodes: str | None = Field(
        default=None, description="A Slurm hostlist decode instances may run on (unset: any)."
    )

    @property
    def side_channel(self) -> bool:
        return self.connector.startswith("Nixl")


class MultiNodeConfig(Section):
    """Replicas that span nodes (`[multi_node]`, `xhpc serve MODEL --nodes N`): one engine whose
    ranks run on N nodes, through vLLM's own multi-node launch."""

    enabled: bool = Field(
        default=False,
        description="Allow `--nodes N` > 1. The ranks of such an engine talk over channels with "
        "no secret (a rendezvous store anyone may write, pickled messages): whoever reaches the "
        "nodes' addresses can read its prompts and answers, and at its start could run code "
        "as its owner. Turn it on only where the node network carries trusted traffic alone "
        "(a cluster-private fabric).",
    )
    whole_nodes: bool = Field(
        default=True,
        description="Such jobs take whole nodes (`--exclusive`): no other job, and so no other "
        "user's process, shares a node with one of the engine's ranks.",
    )
    execute_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for such engines: a rank silent "
        "this long fails the engine (vLLM's own default is 300 s). A first request must fit.",
    )


class EngineConfig(Section):
    """One engine's site settings (`[engines.vllm]`, `[engines.transformers]`,
    `[engines.command]`)."""

    python: Path | None = Field(
        default=None, description="The engine's own Python environment's interpreter."
    )
    command: list[str] = Field(
        default_factory=list,
        description="The `command` engine's command line (any OpenAI-compatible server).",
    )
    args: list[str] = Field(
        default_factory=list, description="Arguments every replica of this engine starts with."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment every replica of this engine starts with."
    )
    startup_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="An engine not answering a real request within this failed.",
    )


HF_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


class ParallelLayout(Section):
    """How a catalog model is split over GPUs on one GPU type (`[models.NAME.layouts.TYPE]`;
    the type `any`: every other one). A replica is tp x pp x dp GPUs: `gpus_per_node` on each
    of that many nodes."""

    tp: int = Field(default=1, ge=1, le=64, description="Tensor parallel size.")
    pp: int = Field(default=1, ge=1, le=64, description="Pipeline parallel size.")
    dp: int = Field(default=1, ge=1, le=64, description="Data parallel size.")
    expert_parallel: bool = Field(
        default=False, description="Experts are spread over the GPUs (mixture-of-experts)."
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs the replica takes on each node (unset: `tp`, a tensor-parallel group "
        "within a node and the pipeline across nodes); must divide tp x pp x dp.",
    )

    @property
    def world(self) -> int:
        """The GPUs of one replica: tp x pp x dp."""
        return self.tp * self.pp * self.dp

    @property
    def per_node(self) -> int:
        return min(self.gpus_per_node or self.tp, self.world)

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    @model_validator(mode="after")
    def _divides(self) -> ParallelLayout:
        if self.world % self.per_node:
            raise ValueError(
                f"gpus_per_node {self.per_node} does not divide tp x pp x dp = {self.world}"
            )
        return self


ANY_GPU_TYPE = "any"  # the layout for every GPU type that has none of its own


class ModelEntry(Section):
    """A catalog model (`[models.NAME]`): the site's, or a member's own (`xhpc models add`)."""

    path: Path | None = Field(
        default=None,
        description="The weights' directory (Hugging Face format); a relative path is under "
        "`models_dir`. Unset: `models_dir` / the last part of `hf_id`.",
    )
    hf_id: str | None = Field(
        default=None, description="The Hugging Face id the weights come from (`org/name`)."
    )
    engine: EngineKind | None = Field(
        default=None, description="The engine that serves it (unset: `default_engine`)."
    )
    gpus: int | None = Field(
        default=None, ge=1, le=64, description="GPUs per replica when `--gpus` is not given."
    )
    engine_args: list[str] = Field(
        default_factory=list,
        description="Engine arguments before the request's own `--engine-arg`s (admitted alike).",
    )
    description: str = Field(default="", description="One line that `xhpc models` shows.")
    engine_config: ModelEngineConfig | None = Field(
        default=None,
        description="How the engine serves this model (`[models.NAME.engine_config]`): tool "
        "calling, reasoning, chat template, context length, speculative decoding… (vLLM; "
        "checked against the installed engine's own options).",
    )
    layouts: dict[str, ParallelLayout] = Field(
        default_factory=dict,
        description="Its parallel layout per GPU type (`[models.NAME.layouts.h100]`, `any` for "
        "the rest): the nodes and GPUs of a replica and the engine's parallel sizes.",
    )

    def layout(self, gpu_type: str | None) -> ParallelLayout | None:
        """The layout for ``gpu_type`` (None: untyped), else the ``any`` one, else None."""
        return self.layouts.get(gpu_type or ANY_GPU_TYPE) or self.layouts.get(ANY_GPU_TYPE)

    @field_validator("hf_id")
    @classmethod
    def _hf_id(cls, value: str | None) -> str | None:
        if value is not None and not HF_ID_RE.fullmatch(value):
            raise ValueError(f"invalid Hugging Face id {value!r}: use org/name")
        return value

    @field_validator("engine_args", "description")
    @classmethod
    def _printable(cls, value: str | list[str]) -> str | list[str]:
        for item in [value] if isinstance(value, str) else value:
            if not item.isprintable():
                raise ValueError(f"{item!r} contains control characters")
        return value

    def weights_path(self, models_dir: Path | None) -> Path | None:
        """Where the weights are: ``path`` (a relative one under ``models_dir``), else
        ``models_dir`` / the last part of ``hf_id``; None when neither gives a place."""
        if self.path is not None and self.path.is_absolute():
            return self.path
        relative = self.path or (Path(self.hf_id.rsplit("/", 1)[-1]) if self.hf_id else None)
        if relative is None or models_dir is None:
            return None
        return models_dir / relative


class XhpcConfig(Section):
    """The whole config: the top-level keys of a site file and its sections."""

    site: str = Field(
        default="default", description="The site's name (shown by `xhpc config show`)."
    )
    state_dir: Path | None = Field(
        default=None,
        description="The broker's state directory; jobs read their replica directories in it, "
        "so on a real site it must be on a filesystem the compute nodes see "
        "(unset: $XDG_STATE_HOME/xhpc, ~/.local/state/xhpc).",
    )
    db_path: Path | None = Field(
        default=None,
        description="The SQLite database; on the login node's local disk (WAL does not work on "
        "network filesystems); unset: `<state_dir>/xhpc.db`.",
    )
    db_url: str | None = Field(
        default=None,
        description="A PostgreSQL database for the state instead of SQLite "
        "(`postgresql://USER@HOST:PORT/DB`, or `postgresql://USER@/DB?host=/run/postgresql` over "
        "its socket), for brokers on two login nodes; its password in the broker user's "
        "`~/.pgpass` (mode 0600), never in the URL.",
    )
    models_dir: Path | None = Field(
        default=None, description="Where catalog models' relative paths are (staged weights)."
    )
    cpu_only: bool = Field(
        default=False, description="CPU engines: OMP_NUM_THREADS=1 and no CUDA in jobs."
    )
    default_engine: EngineKind = Field(
        default=EngineKind.VLLM,
        description="The engine when neither `--engine` nor the model names one.",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="`[slurm]`.")
    broker: BrokerConfig = Field(default_factory=BrokerConfig, description="`[broker]`.")
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="`[proxy]`.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="`[placement]`."
    )
    probe: ProbeSettings = Field(default_factory=ProbeSettings, description="`[probe]`.")
    orphans: OrphanPolicy = Field(default_factory=OrphanPolicy, description="`[orphans]`.")
    pd: PdConfig = Field(default_factory=PdConfig, description="`[pd]`.")
    multi_node: MultiNodeConfig = Field(
        default_factory=MultiNodeConfig, description="`[multi_node]`."
    )
    lifecycle: LifecycleConfig = Field(
        default_factory=LifecycleConfig, description="`[lifecycle]`."
    )
    autoscale: AutoscaleConfig = Field(
        default_factory=AutoscaleConfig, description="`[autoscale]`."
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="`[cache]`.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="`[policy]`.")
    engines: dict[EngineKind, EngineConfig] = Field(
        default_factory=dict, description="`[engines.NAME]`: each engine's site settings."
    )
    models: dict[str, ModelEntry] = Field(
        default_factory=dict, description="`[models.NAME]`: the site's model catalog."
    )

    @property
    def resolved_state_dir(self) -> Path:
        if self.state_dir is not None:
            return self.state_dir
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "xhpc"

    @field_validator("db_url")
    @classmethod
    def _db_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("postgresql", "postgresql+psycopg", "postgres"):
            raise ValueError("must be a PostgreSQL URL: postgresql://USER@HOST:PORT/DB")
        if parts.password is not None:
            raise ValueError("holds a password: put it in the broker user's ~/.pgpass instead")
        if not value.isprintable():
            raise ValueError("contains control characters")
        return value

    @property
    def store_target(self) -> Path | str:
        """What the broker opens its store on: the PostgreSQL URL, else the SQLite path."""
        return self.db_url or self.resolved_db_path

    @property
    def resolved_db_path(self) -> Path:
        return self.db_path or self.resolved_state_dir / "xhpc.db"

    def engine(self, kind: EngineKind) -> EngineConfig:
        return self.engines.get(kind, EngineConfig())
