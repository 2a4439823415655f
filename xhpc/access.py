"""Who may use what (foundation): API keys, their grants as the proxy sees them, and usage.

A key reads ``xhpc-KEYID.SECRET``: the id finds the key, the secret is compared (as a SHA-256
digest) in constant time. Only the digest is stored; the key is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from datetime import datetime

from pydantic import Field, field_validator

from xhpc.models import Frozen, check_name

MAX_COUNT = 10**12  # requests or tokens of one key and model in one usage report
KEY_RE = re.compile(r"^xhpc-([0-9a-f]{12})\.([A-Za-z0-9_-]{20,100})$")


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key() -> tuple[str, str, str]:
    """(key_id, the key to show once, the digest to store)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return key_id, f"xhpc-{key_id}.{secret}", secret_digest(secret)


def split_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret), or None when it is not shaped like an xhpc key."""
    m = KEY_RE.fullmatch(key)
    return (m.group(1), m.group(2)) if m else None


def digest_matches(secret: str, digest: str) -> bool:
    return hmac.compare_digest(secret_digest(secret).encode(), digest.encode())


class KeyCreate(Frozen):
    user: str
    account: str | None = None
    admin: bool = False
    rpm: int | None = Field(default=None, ge=1)
    token_quota: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)  # requests in flight (per worker)

    @field_validator("user", "account")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return v if v is None else check_name(v, "user or account")


class KeyView(Frozen):
    """A key as `xhpc keys list` shows it: never its secret."""

    key_id: str
    user: str
    account: str | None = None
    admin: bool = False
    rpm: int | None = None
    token_quota: int | None = None
    max_concurrent: int | None = None
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreated(Frozen):
    view: KeyView
    key: str  # shown once
    warning: str | None = None  # what could not be checked (no Slurm accounting: a free label)


class KeyGrant(Frozen):
    """What a proxy needs to admit a key: its digest, limits and usage so far."""

    key_id: str
    digest: str = Field(repr=False)
    user: str
    account: str | None = None
    admin: bool = False
    rpm: int | None = None
    token_quota: int | None = None
    max_concurrent: int | None = None
    tokens_used: int = 0


class ModelAccess(Frozen):
    """Who a served model belongs to: its owner's keys, its account's keys and admins use it."""

    model: str
    owner: str | None = None
    account: str | None = None


def may_use(grant: KeyGrant, access: ModelAccess | None) -> bool:
    if grant.admin:
        return True
    if access is None or access.owner is None:
        return False
    if access.owner == grant.user:
        return True
    return access.account is not None and access.account == grant.account


class UsageCount(Frozen):
    """Counts a proxy adds to a key's usage in one report: never negative (that would reset a
    quota), bounded (the sums stay within SQLite's integers)."""

    requests: int = Field(default=0, ge=0, le=MAX_COUNT)
    prompt_tokens: int = Field(default=0, ge=0, le=MAX_COUNT)
    completion_tokens: int = Field(default=0, ge=0, le=MAX_COUNT)


NO_KEY = "-"  # the key_id of a usage line that carries GPU-hours and no key's tokens


class UsageLine(Frozen):
    """Tokens of one key and model, and GPU-hours: those Slurm accounting charged for the
    model's jobs to (user, account): the deployments' owner and the account each job was charged
    to. Each (user, account, model)'s GPU-hours are on one line: its key's when exactly one key
    of that user and account used the model, else a line of their own (``key_id`` NO_KEY, no
    tokens); 0 on the other lines, so the column adds up. None: not known (Slurm keeps no
    accounting, or could not be asked) — never a made-up number."""

    key_id: str
    user: str
    account: str | None = None
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    gpu_hours: float | None = None


# The user the proxy's identity acts for on the control API's user-facing endpoints (the
# Batch API), and the API key it admitted (xhpc.broker.api; xhpc.broker.admit.authz's ``acts``).
ACTING_USER_HEADER = "X-Xhpc-Acting-User"
ACTING_KEY_HEADER = "X-Xhpc-Acting-Key"


class Caller(Frozen):
    """Who is calling the broker's control socket (from the socket's peer credentials).
    ``admin``: may act on every model, manage keys, fix orphans; ``proxy``: may act as the
    proxy (routes with engine secrets, key digests, usage reports).

    A caller the proxy acts for (``delegated``: a key's user, named by the gateway) is never an
    admin; ``key_id`` and ``account`` are its key's (None: no key)."""

    user: str
    uid: int
    admin: bool = False
    proxy: bool = False
    delegated: bool = False
    key_id: str | None = None
    account: str | None = None


def caller_may_use(caller: Caller | None, access: ModelAccess | None) -> bool:
    """Whether ``caller`` may use a served model (send it requests, an online batch): its
    owner, a key of the account it is charged to, admins, and the broker itself (None)."""
    if caller is None or caller.admin:
        return True
    if access is None or access.owner is None:
        return False
    if access.owner == caller.user:
        return True
    return caller.account is not None and access.account == caller.account


def check_owner(caller: Caller | None, owner: str | None, what: str) -> None:
    """PermissionError unless ``caller`` may act on something ``owner`` owns. None: the broker
    itself (internal calls) — allowed; an ownerless deployment predates ownership: admins only."""
    if caller is None or caller.admin or (owner is not None and owner == caller.user):
        return
    raise PermissionError(f"{what} belongs to {owner or 'nobody'}; you are {caller.user}")


class UsageReport(Frozen):
    """A proxy's batched usage since its last report: key -> model -> counts."""

    proxy_id: str
    usage: dict[str, dict[str, UsageCount]] = Field(default_factory=dict)


class Grants(Frozen):
    """What the broker tells proxies about access: the live keys and who owns each model."""

    keys: tuple[KeyGrant, ...] = ()
    access: tuple[ModelAccess, ...] = ()


# Final states of a job's sacct record (REQUEUED is not: the job runs again, in a new record).
ENDED_JOB_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)


class JobUsage(Frozen):
    """One record of a job in Slurm accounting (`sacct`): who ran it, the account charged, and
    its GPUs and run time. A requeued job has a record per run."""

    job_id: str  # "123", "123+1" for a component of hetjob 123, "123_4" for an array task
    user: str
    account: str | None = None
    submitted_at: datetime
    elapsed_s: int = Field(ge=0)
    gpus: int | None = Field(default=None, ge=0)  # None: AllocTRES names no gres/gpu
    state: str  # its first word: "CANCELLED by 0" -> "CANCELLED"

    @property
    def leader(self) -> str:
        """The job xhpc submitted: a hetjob component's leader, an array task's array (a
        batch: ``123_4`` -> ``123``), else the job itself."""
        return self.job_id.split("+", 1)[0].split("_", 1)[0]

    @property
    def ended(self) -> bool:
        return self.state in ENDED_JOB_STATES

    @property
    def gpu_seconds(self) -> int | None:
        """GPUs times seconds run; None when it ran but Slurm does not track its GPUs (no
        ``gres/gpu`` in AccountingStorageTRES)."""
        if self.elapsed_s == 0:
            return 0
        return None if self.gpus is None else self.gpus * self.elapsed_s


class JobCharge(Frozen):
    """One run of a job xhpc submitted for a deployment (a replica's job, or a PD unit's
    hetjob), and whose deployment it was."""

    run: str  # this run in the store: "job-ROWID" (job_runs table) or "unit-UNITID" (jobs table)
    job_id: str  # what sacct is asked about (a hetjob: its leader)
    model: str  # the deployment's name: what clients ask for, and what usage lines name
    owner: str | None = None
    submitted_at: datetime
    ended_at: datetime | None = None  # when the store saw the run end (None: not yet)
