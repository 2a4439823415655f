"""The strict base of every config section, and the gateway's section (`[proxy]`).

Foundation, as xhpc.settings, which imports both from here and holds the rest of the config's
models (kept apart for size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from xhpc.endpoints import ENDPOINTS


class Section(BaseModel):
    # Unknown keys are errors; so are nan and inf (an interval of inf would never fire).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


RoutingPolicyName = Literal["least-outstanding", "round-robin", "affinity"]


_MIB = 1024 * 1024
# The default limit on request bodies per forwarded path (`[proxy.body_limits]`).
BODY_LIMITS: dict[str, int] = {path: e.body_limit for path, e in ENDPOINTS.items()}


MAX_GATEWAYS = 8


def gateway_origin(url: str) -> tuple[str, str, int]:
    """``http[s]://HOST:PORT`` as (scheme, host, port); ValueError for anything else (a path,
    a query, credentials, no port, or a character outside a host name or address)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    if (
        parts.scheme not in ("http", "https")
        or not host
        or port is None
        or not 0 < port < 65536
        or parts.username is not None
        or parts.password is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or not all(c.isalnum() or c in ".-:_" for c in host)
    ):
        raise ValueError(f"{url[:200]!r} is not a gateway address (http[s]://HOST:PORT)")
    return parts.scheme, host, port


class ProxyConfig(Section):
    """The OpenAI gateway (`[proxy]`); see docs/decisions/0005-gateway-routing.md."""

    host: str = Field(default="127.0.0.1", description="The address the gateway listens on.")
    port: int = Field(
        default=8000, ge=0, le=65535, description="The gateway's port (0: any free port)."
    )
    gateways: tuple[str, ...] = Field(
        default=(),
        description="Every gateway of the site as clients reach it (`http[s]://HOST:PORT`, one "
        "per login node), the preferred first: the Python API and `xhpc tunnel` go to the next "
        "one when one cannot be reached (empty: this gateway's own host and port).",
    )
    refresh_interval_s: float = Field(
        default=1.0, gt=0, description="A held routing-table sync is answered after this at most."
    )
    brokers: tuple[Path, ...] = Field(
        default=(),
        description="A lab gateway: the control sockets of the brokers it serves, each run by its "
        "member; the first holds the API keys and gets the usage (empty: this user's broker).",
    )
    upstream_timeout_s: float = Field(
        default=600.0, gt=0, description="An engine's answer must be done within this (else 504)."
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Larger request bodies get 413."
    )
    upstream_idle_s: float = Field(
        default=4.0,
        gt=0,
        description="Idle engine connections are closed after this, before the engine's own "
        "keep-alive (uvicorn: 5 s) would.",
    )
    max_answer_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="Engine answers over this are refused with a 502.",
    )
    auth: Literal["keys", "none"] = Field(
        default="keys",
        description='"keys": every request presents an API key (`xhpc keys create`); "none": '
        "open (dev only).",
    )
    access_log: bool = Field(
        default=False, description="One log line per request (costs about a quarter of throughput)."
    )
    retry_after_s: int = Field(
        default=5,
        ge=1,
        description="The Retry-After told to clients when no replica is ready (503).",
    )
    hold_s: float = Field(
        default=600.0,
        ge=0,
        description="Longest a call to an autoscaled model with no READY replica (asleep, "
        "waking) is held for one; a caller may ask for less (header `X-Xhpc-Max-Wait`, "
        "seconds). 0: never held (503 with Retry-After at once).",
    )
    hold_per_model: int = Field(
        default=64, ge=1, description="Calls held at once per model, per proxy worker."
    )
    hold_per_key: int = Field(
        default=8, ge=1, description="Calls held at once per API key, per proxy worker."
    )
    hold_keepalive_s: float = Field(
        default=10.0,
        gt=0,
        description="A held streamed call gets an SSE comment this often (its response starts "
        "then), so that clients and proxies in between keep it open.",
    )
    routing: RoutingPolicyName = Field(
        default="least-outstanding", description="The routing policy across a model's replicas."
    )
    model_routing: dict[str, RoutingPolicyName] = Field(
        default_factory=dict, description="Per-model routing policies (model name -> policy)."
    )
    affinity_prefix_chars: int = Field(
        default=256, gt=0, description="The prompt prefix hashed by the affinity policy."
    )
    affinity_load_factor: float = Field(
        default=0.25, gt=0, description="Affinity skips replicas over (1 + this) x the mean load."
    )
    pd_prefill_routing: RoutingPolicyName = Field(
        default="affinity",
        description="Prefill/decode models: the prefill role's policy (affinity keeps a prompt "
        "prefix on one prefill instance, whose prefix cache it fills).",
    )
    pd_decode_routing: RoutingPolicyName = Field(
        default="least-outstanding", description="Prefill/decode models: the decode role's policy."
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries per request on another replica, before its first byte reaches the "
        "client.",
    )
    job_check_after_s: float = Field(
        default=2.0,
        gt=0,
        description="A request with no byte of its answer after this has its replica's agent "
        "asked whether the job lives, and again as often; a job gone sends it elsewhere.",
    )
    retry_budget_ratio: float = Field(
        default=0.2, ge=0, description="Retries earned per request (the retry budget)."
    )
    retry_budget_burst: int = Field(
        default=10, ge=0, description="Retries allowed with no traffic yet."
    )
    breaker_failures: int = Field(
        default=5, ge=1, description="Consecutive failures that eject a replica (circuit breaker)."
    )
    breaker_cooldown_s: float = Field(
        default=10.0, gt=0, description="An ejected replica gets one probe request after this."
    )
    workers: int = Field(
        default=2,
        ge=1,
        description="Worker processes sharing the port (1: one process, no supervisor).",
    )
    drain_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On reload (SIGHUP) or stop, in-flight requests finish within this.",
    )
    continue_streams: bool = Field(
        default=False,
        description="A stream whose engine dies goes on on another replica from the tokens "
        "already sent (vLLM engines); per request: the `X-Xhpc-Continue: 1|0` header.",
    )
    max_continuations: int = Field(default=1, ge=1, description="Continuations per request.")
    quota_default_max_tokens: int = Field(
        default=1024,
        ge=1,
        description="The output budget a request with no max_tokens reserves against its key's "
        "token quota.",
    )
    metrics_listen: str | None = Field(
        default=None,
        description='"host:port": also serve /metrics there with no key (keep it private); on the '
        'gateway\'s port /metrics needs an admin key when `auth = "keys"`.',
    )
    client_header_timeout_s: float = Field(
        default=10.0, gt=0, description="A request's head must arrive whole within this (else 408)."
    )
    client_body_timeout_s: float = Field(
        default=30.0, gt=0, description="A request's body must arrive within this after its head."
    )
    client_keepalive_timeout_s: float = Field(
        default=60.0, gt=0, description="An idle kept-alive client connection is closed after this."
    )
    max_connections: int = Field(
        default=4096, ge=1, description="Clients per worker process at once (one more: 503)."
    )
    bytes_per_context_token: int = Field(
        default=128,
        ge=0,
        description="A request to a model whose engine states its context length (vLLM) is "
        "refused when its body is over this many bytes per token of context (+64 KiB); 0: no "
        "check.",
    )
    body_limits: dict[str, PositiveInt] = Field(
        default_factory=lambda: dict(BODY_LIMITS),
        description="Request body limits per path (each also capped by `max_body_bytes`); "
        "paths left out keep theirs.",
    )
    files_max_count: int = Field(
        default=100,
        ge=1,
        description="Batch API files (`/v1/files`) kept per user at once; one more upload is "
        "refused (400 `too_many_files`) until one is deleted or expires.",
    )
    files_max_bytes: int = Field(
        default=1024 * _MIB,
        gt=0,
        description="The bytes of a user's Batch API files together; an upload that would pass "
        "it is refused (400 `storage_quota_exceeded`).",
    )
    files_max_file_bytes: int = Field(
        default=64 * _MIB,
        gt=0,
        description="One uploaded file's bytes; a larger upload is refused (413 `file_too_large`) "
        "as soon as it passes this, and nothing of it is kept (OpenAI's own limit is 200 MB).",
    )
    files_max_lines: int = Field(
        default=100_000,
        ge=1,
        description="Lines of one uploaded file (blank ones included); more: refused (400 "
        "`too_many_lines`).",
    )
    files_max_age_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="Uploaded files older than this are deleted: on their user's next files call, "
        "and by the gateway's sweep of every user (each `files_max_age_s / 10`, at most hourly).",
    )
    files_upload_bytes_per_s: float | None = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="One upload is read at this pace at most, so that a tenant's large files "
        "leave the gateway's workers to the other tenants' requests (unset: as fast as it "
        "comes).",
    )
    batches_per_minute: int | None = Field(
        default=30,
        ge=1,
        description="Batches one user may create a minute through one gateway worker, besides "
        "the key's own rate; more: 429 `rate_limited` (unset: the key's rate only).",
    )
    batch_api_calls_per_s: float | None = Field(
        default=10.0,
        gt=0,
        description="Files and Batch API calls of one user a second through one gateway worker, "
        "after a burst of 20: a call over this pace waits its turn, and one more while 16 of the "
        "user's calls wait is refused (429 `rate_limited`); unset: every call at once.",
    )
    tls_cert_file: Path | None = Field(
        default=None,
        description="HTTPS on the gateway's port: the certificate (chain), PEM, an absolute path; "
        "set both TLS files or neither.",
    )
    tls_key_file: Path | None = Field(
        default=None,
        description="HTTPS on the gateway's port: the private key, PEM, an absolute path.",
    )

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
    def _absolute_file(cls, value: Path | None) -> Path | None:
        # Only the gateway's user reads the files (the key is 0600): every other user loads
        # this site file too, so the files are opened when the gateway starts
        # (xhpc.proxy.process.tls: one line naming the file when it cannot), not here.
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_absolute():
            raise ValueError(f"{str(value)!r} must be an absolute path")
        return path

    @field_validator("gateways")
    @classmethod
    def _gateway_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) > MAX_GATEWAYS:
            raise ValueError(f"at most {MAX_GATEWAYS} gateways")
        for url in value:
            gateway_origin(url)
        if len(set(value)) != len(value):
            raise ValueError("a gateway is listed twice")
        return value

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
