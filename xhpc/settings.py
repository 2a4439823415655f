"""Configuration models (foundation): what a site, a user or the command line may set.

Loaded only by xhpc.config (the one reader of config files and XHPC_* variables).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from xhpc.models import EngineKind


class Section(BaseModel):
    # Unknown keys are errors; so are nan and inf (an interval of inf would never fire).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SlurmConfig(Section):
    conf_path: Path | None = None  # exported as SLURM_CONF to every Slurm command
    bin_dir: Path | None = None
    partition: str | None = None
    default_time: str = "01:00:00"
    account: str | None = None
    command_timeout_s: float = Field(default=30.0, gt=0)
    cpus_per_replica: int = Field(default=1, ge=1)
    mem_per_replica_mb: int | None = Field(default=None, gt=0)


class BrokerConfig(Section):
    agent_bind: str = "0.0.0.0"
    agent_port: int = Field(default=0, ge=0, le=65535)  # 0: any free port
    advertise_host: str | None = None  # the address compute nodes use to reach the broker
    reconcile_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_timeout_s: float = Field(default=20.0, gt=0)
    # a draining replica's job is cancelled after this at most (0: at once, no drain)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    pilot_poll_s: float = Field(default=1.0, gt=0)  # how often a pilot agent asks for orders
    id: str | None = None  # tags this broker's jobs; None: one generated once per state dir
    admins: list[str] = Field(default_factory=list)  # Unix users who may act on every model
    shared_socket: bool = False  # other Unix users may reach the control socket (lab broker)
    # A group whose members may reach the control socket: a member's broker shares it with the
    # lab gateway's user this way (socket 0660, state directory 0710, both of this group)
    socket_group: str | None = None
    # Unix users who may act as the proxy (routes with engine secrets, key digests, usage
    # reports); the broker's own user and root always may
    proxy_users: list[str] = Field(default_factory=list)
    # The control API for jobs (the Python API inside an sbatch script): on ``agent_bind``, this
    # port (0: any free one), each call with the token in the state directory (control.token,
    # 0600), as the broker's user without admin or proxy rights. Off: only the unix socket.
    remote_control: bool = True
    remote_control_port: int = Field(default=0, ge=0, le=65535)


class LifecycleConfig(Section):
    """How deployments outlive their jobs (`[lifecycle]`); see docs/lifecycle.md."""

    restart: Literal["always", "on-failure", "never"] = "always"  # the site's default policy
    backoff_s: float = Field(default=5.0, ge=0)  # before the first replacement after a failure
    backoff_max_s: float = Field(default=300.0, ge=0)  # doubling up to this
    crash_loop_starts: int = Field(default=3, ge=1)  # failed starts in the window: FAILED
    crash_loop_window_s: float = Field(default=600.0, gt=0)
    node_cooldown_s: float = Field(default=600.0, ge=0)  # a node that failed a replica is avoided
    lost_grace_s: float = Field(default=60.0, ge=0)  # a LOST replica is replaced after this
    restart_grace_s: float = Field(default=30.0, ge=0)  # after a broker start, before LOST
    # Walltime handover: a successor is submitted this long before a job's end at least; the
    # lead grows to cover the deployment's measured queue wait + engine start (x handover_margin).
    handover_floor_s: float = Field(default=120.0, ge=0)
    handover_margin: float = Field(default=1.5, ge=1)


BackendKind = Literal["auto", "nvml", "fake"]


class ProbeSettings(Section):
    backend: BackendKind = "auto"  # auto: NVML when the driver answers, else the fake backend
    interval_s: float = Field(default=5.0, gt=0)
    post_timeout_s: float = Field(default=10.0, gt=0)
    fake_file: Path | None = None  # TOML or JSON describing the fake GPUs; re-read every sample
    fake_gpus: int = Field(default=0, ge=0, le=1024)  # idle fake GPUs when there is no fake_file
    proc_root: Path = Path("/proc")  # where GPU processes are looked up to find their Slurm jobs
    broker_file: Path | None = None  # the broker's address file (None: <state_dir>/broker.json)
    token_file: Path | None = None  # the node token presented to the broker


class OrphanPolicy(Section):
    """What `xhpc doctor --fix` does per kind of orphan (the `[orphans]` section). GPU processes
    with no Slurm job are only ever reported: xhpc never kills processes it did not start."""

    gpu_process: Literal["report"] = "report"
    job_without_replica: Literal["report", "cancel", "adopt"] = "report"
    replica_without_job: Literal["report", "mark-lost"] = "mark-lost"


class PlacementConfig(Section):
    strategy: str = "idle-first"  # "idle-first" | "pack"
    # a reservation still pending after this is released
    reservation_timeout_s: float = Field(default=300.0, gt=0)
    probe_ttl_s: float = Field(default=30.0, gt=0)  # older probe reports stop counting
    # how old a shared sinfo/squeue view `serve` may use (0: always a fresh one)
    max_view_age_s: float = Field(default=2.0, ge=0)
    gpu_sharing: bool = False  # may two replicas be pinned to the same GPU?
    # a replica pending this long on xhpc's node choice moves
    replan_after_s: float = Field(default=120.0, gt=0)
    max_replans: int = Field(default=3, ge=0)


RoutingPolicyName = Literal["least-outstanding", "round-robin", "affinity"]


_MIB = 1024 * 1024
# The default limit on request bodies per forwarded path (`[proxy.body_limits]`).
BODY_LIMITS: dict[str, int] = {
    "/v1/chat/completions": 4 * _MIB,
    "/v1/completions": 4 * _MIB,
    "/v1/embeddings": 16 * _MIB,
}


class ProxyConfig(Section):
    """The OpenAI gateway (`[proxy]`); see docs/decisions/0005-gateway-routing.md."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    refresh_interval_s: float = Field(default=1.0, gt=0)
    # a lab gateway (decision 0014): the control sockets of the brokers it serves, each run by
    # its member; the first holds the API keys and gets the usage. Empty: this user's broker.
    brokers: tuple[Path, ...] = ()
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)  # larger requests get 413
    # engine connections: idle ones are closed before the engine's own keep-alive (uvicorn: 5 s)
    # would; answers over max_answer_bytes are refused with a 502
    upstream_idle_s: float = Field(default=4.0, gt=0)
    max_answer_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    # "keys": every request presents an API key (`xhpc keys create`); "none": open (dev only)
    auth: Literal["keys", "none"] = "keys"
    access_log: bool = False  # one log line per request (costs ~25% of throughput)
    retry_after_s: int = Field(default=5, ge=1)  # told to clients when no replica is ready
    # routing: the default policy, and per-model overrides (model name -> policy)
    routing: RoutingPolicyName = "least-outstanding"
    model_routing: dict[str, RoutingPolicyName] = Field(default_factory=dict)
    affinity_prefix_chars: int = Field(default=256, gt=0)  # prompt prefix hashed for affinity
    affinity_load_factor: float = Field(default=0.25, gt=0)  # skip replicas over (1+e) x mean
    # prefill/decode models (routes with roles): a policy per role (decision 0009); affinity
    # keeps a prompt prefix on one prefill instance, whose prefix cache it fills
    pd_prefill_routing: RoutingPolicyName = "affinity"
    pd_decode_routing: RoutingPolicyName = "least-outstanding"
    # retries before the first byte reaches the client, to another replica
    max_retries: int = Field(default=2, ge=0)  # per request
    # a request with no byte of its answer after this has its replica's agent asked whether
    # the job lives, and again as often: a job gone (a lost node or link) sends it elsewhere
    job_check_after_s: float = Field(default=2.0, gt=0)
    retry_budget_ratio: float = Field(default=0.2, ge=0)  # retries earned per request
    retry_budget_burst: int = Field(default=10, ge=0)  # retries allowed with no traffic yet
    # circuit breaker per replica
    breaker_failures: int = Field(default=5, ge=1)  # consecutive failures that eject it
    breaker_cooldown_s: float = Field(default=10.0, gt=0)  # until one probe is let through
    # worker processes sharing the listening socket (1: one process, no supervisor); a reload
    # (SIGHUP) or a stop gives a worker's requests this long to finish (decision 0010)
    workers: int = Field(default=2, ge=1)
    drain_grace_s: float = Field(default=30.0, ge=0)
    # a stream whose engine dies mid-way goes on on another replica, from the tokens already
    # sent (vLLM engines; decision 0012); per request: the `X-Xhpc-Continue: 1|0` header
    continue_streams: bool = False
    max_continuations: int = Field(default=1, ge=1)  # per request
    # token quotas: each request reserves its output budget while it runs (decision 0007);
    # this budget when it sets no max_tokens (transformers' own default)
    quota_default_max_tokens: int = Field(default=1024, ge=1)
    # "host:port": also serve /metrics there, with no key (keep it on a private address); on
    # the gateway's port /metrics needs an admin key when `auth = "keys"`
    metrics_listen: str | None = None
    # clients (decision 0013): a request's head must arrive whole within the header timeout (from
    # the connection's start, or from its first byte on a kept-alive connection), its body within
    # the body timeout after its head; an idle kept-alive connection is closed after the
    # keep-alive timeout; a worker serves at most max_connections clients at once (more: 503)
    client_header_timeout_s: float = Field(default=10.0, gt=0)
    client_body_timeout_s: float = Field(default=30.0, gt=0)
    client_keepalive_timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=4096, ge=1)  # per worker process
    # a request to a model whose engine states its context length (vLLM) is refused when its
    # body is over this many bytes per token of context (+64 KiB); 0: no such check
    bytes_per_context_token: int = Field(default=128, ge=0)
    # request bodies per path, each also capped by max_body_bytes; paths left out keep theirs
    body_limits: dict[str, PositiveInt] = Field(default_factory=lambda: dict(BODY_LIMITS))
    # HTTPS on the gateway's port: both files (PEM, absolute paths) or neither
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @field_validator("metrics_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @field_validator("body_limits")
    @classmethod
    def _known_paths(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(BODY_LIMITS))
        if unknown:
            raise ValueError(
                f"unknown path(s) {', '.join(unknown)}; valid paths: {', '.join(BODY_LIMITS)}"
            )
        return {**BODY_LIMITS, **value}

    @field_validator("tls_cert_file", "tls_key_file")
    @classmethod
    def _readable_file(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_absolute():
            raise ValueError(f"{str(value)!r} must be an absolute path")
        if not path.is_file():
            raise ValueError(f"{str(path)!r} is not a file")
        if not os.access(path, os.R_OK):
            raise ValueError(f"{str(path)!r} is not readable")
        return path

    @field_validator("brokers")
    @classmethod
    def _socket_paths(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        paths = tuple(p.expanduser() for p in value)
        for path in paths:
            if not path.is_absolute():
                raise ValueError(f"{str(path)!r} must be an absolute path")
        if len(set(paths)) != len(paths):
            raise ValueError("a broker is listed twice")
        return paths

    @model_validator(mode="after")
    def _tls_pair(self) -> ProxyConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        return self

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return None if self.metrics_listen is None else split_host_port(self.metrics_listen)

    @property
    def tls(self) -> tuple[Path, Path] | None:
        """The certificate (chain) and key files of HTTPS on the gateway's port, if set."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return self.tls_cert_file, self.tls_key_file

    def body_limit(self, path: str) -> int:
        """The largest request body the gateway reads for ``path``."""
        return min(self.body_limits.get(path, self.max_body_bytes), self.max_body_bytes)


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); ValueError when it is not one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not host:port (a port from 0 to 65535)")
    return host, int(port)


class PdConfig(Section):
    """Prefill/decode disaggregation (`[pd]`): the vLLM KV connector every PD unit uses."""

    connector: str = "NixlConnector"  # or "ExampleConnector" (files in a shared directory)
    kv_buffer_device: str | None = None  # NIXL: "cpu" on CPU sites (None: vLLM's default)
    # Extra `kv_connector_extra_config`; "{unit_dir}" is replaced by the unit's own shared
    # directory (ExampleConnector's shared_storage_path).
    extra_config: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)  # e.g. UCX_TLS for NIXL over TCP
    prefill_args: list[str] = Field(default_factory=list)  # site defaults per role
    decode_args: list[str] = Field(default_factory=list)
    prefill_nodes: str | None = None  # Slurm hostlists the roles may run on (None: any)
    decode_nodes: str | None = None

    @property
    def side_channel(self) -> bool:
        return self.connector.startswith("Nixl")


class EngineConfig(Section):
    python: Path | None = None  # the engine's own Python environment
    command: list[str] = Field(default_factory=list)  # for the `command` engine
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(default=600.0, gt=0)


HF_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


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
    site: str = "default"
    state_dir: Path | None = None
    db_path: Path | None = None
    models_dir: Path | None = None
    cpu_only: bool = False
    default_engine: EngineKind = EngineKind.VLLM
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    orphans: OrphanPolicy = Field(default_factory=OrphanPolicy)
    pd: PdConfig = Field(default_factory=PdConfig)
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)
    engines: dict[EngineKind, EngineConfig] = Field(default_factory=dict)
    models: dict[str, ModelEntry] = Field(default_factory=dict)

    @property
    def resolved_state_dir(self) -> Path:
        if self.state_dir is not None:
            return self.state_dir
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "xhpc"

    @property
    def resolved_db_path(self) -> Path:
        return self.db_path or self.resolved_state_dir / "xhpc.db"

    def engine(self, kind: EngineKind) -> EngineConfig:
        return self.engines.get(kind, EngineConfig())
