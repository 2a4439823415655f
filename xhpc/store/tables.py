"""SQL tables (sqlmodel) and the versioned migrations that create them."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel


class DeploymentRow(SQLModel, table=True):
    __tablename__ = "deployments"

    name: str = Field(primary_key=True)
    model: str
    model_path: str
    engine: str
    gpus: int
    partition: str | None = None
    time_limit: str | None = None
    nodelist: str | None = None
    engine_args: str = "[]"  # JSON list
    created_at: datetime
    stopped_at: datetime | None = None
    gpu_type: str | None = None  # remembered so `xhpc scale` adds replicas of the same kind
    pilot_node: str | None = None  # replicas run in the pilot job on this node
    owner: str | None = None  # the Unix user who served it (None: before ownership existed)
    account: str | None = None  # the Slurm account its jobs are charged to
    pd: str | None = None  # "xPyD": replicas are instances of PD units (hetjobs)
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    prefill_args: str = "[]"  # JSON list
    decode_args: str = "[]"
    # Desired state: the request as served (ServeRequest JSON), how many replicas (or PD units)
    # the reconcile loop keeps, the restart policy, when it ends by itself, why it failed.
    request: str | None = None
    wanted: int = 0
    restart: str = "always"
    until_at: datetime | None = None
    failed_reason: str | None = None
    sleeping: bool = False  # at 0 replicas by its scaling policy (not stopped): a call wakes it


class ReplicaRow(SQLModel, table=True):
    __tablename__ = "replicas"

    replica_id: str = Field(primary_key=True)
    deployment: str = Field(foreign_key="deployments.name", index=True)
    idx: int
    state: str = Field(index=True)
    engine: str
    job_id: str | None = Field(default=None, index=True)
    node: str | None = None
    host: str | None = None
    port: int | None = None
    gpus: str = ""  # comma-separated indexes
    served_model: str | None = None
    reason: str | None = None
    token_hash: str | None = None
    replica_dir: str | None = None
    last_heartbeat: datetime | None = None
    placed_node: str | None = None  # the node xhpc chose (None: pinned by the user, or Slurm's)
    replans: int = 0
    pilot_id: str | None = Field(default=None, index=True)  # runs inside this pilot job
    pinned: str = ""  # comma-separated GPU indexes asked for inside a pilot
    gpus_asked: int = 0  # the GPU count this replica asked for (0: not recorded)
    # The secret its engine requires (the proxy presents it); the DB is owner-only.
    engine_secret: str | None = None
    pd_role: str | None = None  # "prefill" | "decode" for an instance of a PD unit
    pd_unit: str | None = Field(default=None, index=True)
    side_channel_port: int | None = None
    max_model_len: int | None = None  # the engine's context length, as its agent read it
    agent_port: int | None = None  # its agent's liveness port (xhpc.agent.liveness)
    successor_of: str | None = None  # the replica this one takes over from (walltime handover)
    ready_at: datetime | None = None  # when it first answered (None: never served)
    ends_at: datetime | None = None  # its job's end (Slurm's start + time limit)
    restarts: int = 0  # agents of an earlier run of its (requeued) job are refused
    created_at: datetime
    updated_at: datetime


class JobRunRow(SQLModel, table=True):
    """One run of a replica's Slurm job: (replica_id, job_id, submitted_at) identifies it.

    Slurm's job ids restart when its controller is rebuilt, so a job id alone may name jobs of
    two replicas; lookups are by (replica_id, job_id), the newest row first. ``ended_at`` is set
    once the replica has left the job (it ended, vanished, or the replica moved on)."""

    __tablename__ = "job_runs"

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    replica_id: str = Field(foreign_key="replicas.replica_id", index=True)
    slurm_state: str
    reason: str | None = None
    node: str | None = None
    gres_detail: str | None = None
    script_path: str | None = None
    output_path: str | None = None
    submitted_at: datetime
    ended_at: datetime | None = None


class JobRow(SQLModel, table=True):
    """A Slurm job that hosts replicas, whatever its shape (``kind``): a pilot holding a node's
    GPUs, a PD unit's heterogeneous job. One state machine (xhpc.states) for every kind."""

    __tablename__ = "jobs"

    key: str = Field(primary_key=True)  # the pilot's or the unit's id
    kind: str = Field(index=True)  # JobKind
    deployment: str | None = Field(default=None, index=True)  # None: serves several (a pilot)
    idx: int = 0
    spec: str = ""  # a PD unit's "xPyD"
    node: str | None = None  # the node it holds (a pilot)
    gpus: int = 0  # the GPUs it holds (a pilot)
    state: str = Field(index=True)  # JobState
    job_id: str | None = Field(default=None, index=True)
    token_hash: str | None = None  # its own agent's token, as a digest (a pilot)
    job_dir: str | None = None
    output_path: str | None = None
    devices: str = ""  # comma-separated indexes the job can see, as its agent reports them
    reason: str | None = None
    last_heartbeat: datetime | None = None
    created_at: datetime
    updated_at: datetime


class EventRow(SQLModel, table=True):
    __tablename__ = "events"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime
    replica_id: str | None = Field(default=None, index=True)
    deployment: str | None = None
    kind: str
    message: str


class ReservationRow(SQLModel, table=True):
    """GPUs promised to a replica, written with its CREATING row, released once Slurm allocates."""

    __tablename__ = "reservations"

    replica_id: str = Field(primary_key=True, foreign_key="replicas.replica_id")
    node: str
    gpus: int
    created_at: datetime
    released_at: datetime | None = Field(default=None, index=True)
    release_reason: str | None = None
    also: str = ""  # a replica across nodes: the other nodes of its set, comma-separated


# Versioned migrations: each is a list of SQL statements; version N is applied once, in order.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """CREATE TABLE deployments (
                name TEXT PRIMARY KEY, model TEXT NOT NULL, model_path TEXT NOT NULL,
                engine TEXT NOT NULL, gpus INTEGER NOT NULL, partition TEXT, time_limit TEXT,
                nodelist TEXT, engine_args TEXT NOT NULL DEFAULT '[]',
                created_at TIMESTAMP NOT NULL, stopped_at TIMESTAMP)""",
            """CREATE TABLE replicas (
                replica_id TEXT PRIMARY KEY,
                deployment TEXT NOT NULL REFERENCES deployments(name),
                idx INTEGER NOT NULL, state TEXT NOT NULL, engine TEXT NOT NULL, job_id TEXT,
                node TEXT, host TEXT, port INTEGER, gpus TEXT NOT NULL DEFAULT '',
                served_model TEXT, reason TEXT, token_hash TEXT, replica_dir TEXT,
                last_heartbeat TIMESTAMP, created_at TIMESTAMP NOT NULL,
                updated_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_replicas_deployment ON replicas(deployment)",
            "CREATE INDEX ix_replicas_state ON replicas(state)",
            "CREATE INDEX ix_replicas_job_id ON replicas(job_id)",
            """CREATE TABLE jobs (
                job_id TEXT PRIMARY KEY,
                replica_id TEXT NOT NULL REFERENCES replicas(replica_id),
                slurm_state TEXT NOT NULL, reason TEXT, node TEXT, gres_detail TEXT,
                script_path TEXT, output_path TEXT, submitted_at TIMESTAMP NOT NULL,
                ended_at TIMESTAMP)""",
            "CREATE INDEX ix_jobs_replica_id ON jobs(replica_id)",
            """CREATE TABLE events (
                id INTEGER PRIMARY KEY AUTOINCREMENT, at TIMESTAMP NOT NULL, replica_id TEXT,
                deployment TEXT, kind TEXT NOT NULL, message TEXT NOT NULL)""",
            "CREATE INDEX ix_events_replica_id ON events(replica_id)",
        ],
    ),
]

MIGRATIONS.append(
    (
        2,
        [
            """CREATE TABLE reservations (
                replica_id TEXT PRIMARY KEY REFERENCES replicas(replica_id),
                node TEXT NOT NULL, gpus INTEGER NOT NULL, created_at TIMESTAMP NOT NULL,
                released_at TIMESTAMP, release_reason TEXT)""",
            "CREATE INDEX ix_reservations_released_at ON reservations(released_at)",
        ],
    )
)

MIGRATIONS.append(
    (
        3,
        [
            "ALTER TABLE replicas ADD COLUMN placed_node TEXT",
            "ALTER TABLE replicas ADD COLUMN replans INTEGER NOT NULL DEFAULT 0",
        ],
    )
)

MIGRATIONS.append(
    (
        4,
        [
            """CREATE TABLE pilots (
                pilot_id TEXT PRIMARY KEY, node TEXT NOT NULL, gpus INTEGER NOT NULL,
                state TEXT NOT NULL, job_id TEXT, token_hash TEXT NOT NULL,
                pilot_dir TEXT NOT NULL, output_path TEXT, devices TEXT NOT NULL DEFAULT '',
                reason TEXT, last_heartbeat TIMESTAMP, created_at TIMESTAMP NOT NULL,
                updated_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_pilots_node ON pilots(node)",
            "CREATE INDEX ix_pilots_state ON pilots(state)",
            "CREATE INDEX ix_pilots_job_id ON pilots(job_id)",
            "ALTER TABLE replicas ADD COLUMN pilot_id TEXT",
            "ALTER TABLE replicas ADD COLUMN pinned TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE replicas ADD COLUMN gpus_asked INTEGER NOT NULL DEFAULT 0",
            "CREATE INDEX ix_replicas_pilot_id ON replicas(pilot_id)",
            "ALTER TABLE deployments ADD COLUMN gpu_type TEXT",
            "ALTER TABLE deployments ADD COLUMN pilot_node TEXT",
        ],
    )
)


class ApiKeyRow(SQLModel, table=True):
    """A lab user's key for the gateway: only its hash is kept (the key is shown once)."""

    __tablename__ = "api_keys"

    key_id: str = Field(primary_key=True)
    secret_hash: str
    user: str = Field(index=True)
    account: str | None = None
    admin: bool = False
    rpm: int | None = None  # requests per minute (None: unlimited)
    token_quota: int | None = None  # prompt + completion tokens in all (None: unlimited)
    max_concurrent: int | None = None  # requests in flight per proxy worker (None: unlimited)
    created_at: datetime
    revoked_at: datetime | None = None


class UsageRow(SQLModel, table=True):
    """Requests and tokens per key and model, as the proxies report them (batched)."""

    __tablename__ = "usage"

    key_id: str = Field(primary_key=True)
    model: str = Field(primary_key=True)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    updated_at: datetime


MIGRATIONS.append(
    (
        5,
        [
            "ALTER TABLE replicas ADD COLUMN engine_secret TEXT",
            "ALTER TABLE deployments ADD COLUMN owner TEXT",
            "ALTER TABLE deployments ADD COLUMN account TEXT",
            """CREATE TABLE api_keys (
                key_id TEXT PRIMARY KEY, secret_hash TEXT NOT NULL, user TEXT NOT NULL,
                account TEXT, admin BOOLEAN NOT NULL DEFAULT 0, rpm INTEGER,
                token_quota INTEGER, created_at TIMESTAMP NOT NULL, revoked_at TIMESTAMP)""",
            "CREATE INDEX ix_api_keys_user ON api_keys(user)",
            """CREATE TABLE usage (
                key_id TEXT NOT NULL, model TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0, updated_at TIMESTAMP NOT NULL,
                PRIMARY KEY (key_id, model))""",
        ],
    )
)


MIGRATIONS.append(
    (
        6,
        [
            "ALTER TABLE replicas ADD COLUMN pd_role TEXT",
            "ALTER TABLE replicas ADD COLUMN pd_unit TEXT",
            "ALTER TABLE replicas ADD COLUMN side_channel_port INTEGER",
            "CREATE INDEX ix_replicas_pd_unit ON replicas(pd_unit)",
            "ALTER TABLE deployments ADD COLUMN pd TEXT",
            "ALTER TABLE deployments ADD COLUMN prefill_gpus INTEGER",
            "ALTER TABLE deployments ADD COLUMN decode_gpus INTEGER",
            "ALTER TABLE deployments ADD COLUMN prefill_args TEXT NOT NULL DEFAULT '[]'",
            "ALTER TABLE deployments ADD COLUMN decode_args TEXT NOT NULL DEFAULT '[]'",
            """CREATE TABLE units (
                unit_id TEXT PRIMARY KEY, deployment TEXT NOT NULL REFERENCES deployments(name),
                idx INTEGER NOT NULL, spec TEXT NOT NULL, job_id TEXT, state TEXT NOT NULL,
                reason TEXT, created_at TIMESTAMP NOT NULL, updated_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_units_deployment ON units(deployment)",
        ],
    )
)

MIGRATIONS.append(
    (
        7,
        [
            "ALTER TABLE deployments ADD COLUMN request TEXT",
            "ALTER TABLE deployments ADD COLUMN wanted INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE deployments ADD COLUMN restart TEXT NOT NULL DEFAULT 'always'",
            "ALTER TABLE deployments ADD COLUMN until_at TIMESTAMP",
            "ALTER TABLE deployments ADD COLUMN failed_reason TEXT",
            "ALTER TABLE replicas ADD COLUMN successor_of TEXT",
            "ALTER TABLE replicas ADD COLUMN ready_at TIMESTAMP",
            "ALTER TABLE replicas ADD COLUMN ends_at TIMESTAMP",
            "ALTER TABLE replicas ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0",
        ],
    )
)

_JOB_COLUMNS = (
    "job_id, replica_id, slurm_state, reason, node, gres_detail, script_path, output_path,"
    " submitted_at, ended_at"
)

# Jobs get their own key (Slurm's ids restart after a controller rebuild). SQLite cannot change
# a primary key in place: the table is rebuilt. Rows of jobs their replicas have already left
# (the replica ended, or records another job) are closed, at the replica's last update.
MIGRATIONS.append(
    (
        8,
        [
            """CREATE TABLE jobs_new (
                id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
                replica_id TEXT NOT NULL REFERENCES replicas(replica_id),
                slurm_state TEXT NOT NULL, reason TEXT, node TEXT, gres_detail TEXT,
                script_path TEXT, output_path TEXT, submitted_at TIMESTAMP NOT NULL,
                ended_at TIMESTAMP)""",
            f"INSERT INTO jobs_new ({_JOB_COLUMNS}) SELECT {_JOB_COLUMNS} FROM jobs"
            " ORDER BY submitted_at, job_id",
            "DROP TABLE jobs",
            "ALTER TABLE jobs_new RENAME TO jobs",
            "CREATE INDEX ix_jobs_job_id ON jobs(job_id)",
            "CREATE INDEX ix_jobs_replica_id ON jobs(replica_id)",
            "CREATE UNIQUE INDEX ix_jobs_run ON jobs(replica_id, job_id, submitted_at)",
            """UPDATE jobs SET ended_at = (
                SELECT r.updated_at FROM replicas r WHERE r.replica_id = jobs.replica_id)
            WHERE ended_at IS NULL AND EXISTS (
                SELECT 1 FROM replicas r WHERE r.replica_id = jobs.replica_id
                AND (r.state IN ('STOPPED', 'FAILED') OR r.job_id IS NULL
                     OR r.job_id != jobs.job_id))""",
        ],
    )
)

MIGRATIONS.append((9, ["ALTER TABLE api_keys ADD COLUMN max_concurrent INTEGER"]))
MIGRATIONS.append((10, ["ALTER TABLE replicas ADD COLUMN max_model_len INTEGER"]))
MIGRATIONS.append((11, ["ALTER TABLE replicas ADD COLUMN agent_port INTEGER"]))


class CacheCopyRow(SQLModel, table=True):
    """A copy of a model's weights: the shared store's (``node`` "") or one on a node's local
    disk, with its content digest (computed once), size, last use and the replicas that used it."""

    __tablename__ = "cache_copies"

    model: str = Field(primary_key=True)
    node: str = Field(primary_key=True)  # "": the shared model store
    path: str
    size_bytes: int
    digest: str
    users: str = ""  # comma-separated replica ids
    last_used_at: datetime | None = None
    created_at: datetime


MIGRATIONS.append(
    (
        12,
        [
            """CREATE TABLE cache_copies (
                model TEXT NOT NULL, node TEXT NOT NULL, path TEXT NOT NULL,
                size_bytes INTEGER NOT NULL, digest TEXT NOT NULL, users TEXT NOT NULL DEFAULT '',
                last_used_at TIMESTAMP, created_at TIMESTAMP NOT NULL,
                PRIMARY KEY (model, node))""",
        ],
    )
)

# One jobs table: the runs of replicas' jobs move to ``job_runs``, and pilots and PD units become
# rows of ``jobs`` (their states are the one job state machine's, by the same names).
MIGRATIONS.append(
    (
        13,
        [
            "ALTER TABLE jobs RENAME TO job_runs",
            "DROP INDEX ix_jobs_job_id",
            "DROP INDEX ix_jobs_replica_id",
            "DROP INDEX ix_jobs_run",
            "CREATE INDEX ix_job_runs_job_id ON job_runs(job_id)",
            "CREATE INDEX ix_job_runs_replica_id ON job_runs(replica_id)",
            "CREATE UNIQUE INDEX ix_job_runs_run ON job_runs(replica_id, job_id, submitted_at)",
            """CREATE TABLE jobs (
                key TEXT PRIMARY KEY, kind TEXT NOT NULL, deployment TEXT,
                idx INTEGER NOT NULL DEFAULT 0, spec TEXT NOT NULL DEFAULT '', node TEXT,
                gpus INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL, job_id TEXT,
                token_hash TEXT, job_dir TEXT, output_path TEXT,
                devices TEXT NOT NULL DEFAULT '', reason TEXT, last_heartbeat TIMESTAMP,
                created_at TIMESTAMP NOT NULL, updated_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_jobs_kind ON jobs(kind)",
            "CREATE INDEX ix_jobs_deployment ON jobs(deployment)",
            "CREATE INDEX ix_jobs_state ON jobs(state)",
            "CREATE INDEX ix_jobs_job_id ON jobs(job_id)",
            """INSERT INTO jobs (key, kind, node, gpus, state, job_id, token_hash, job_dir,
                output_path, devices, reason, last_heartbeat, created_at, updated_at)
            SELECT pilot_id, 'pilot', node, gpus, state, job_id, token_hash, pilot_dir,
                output_path, devices, reason, last_heartbeat, created_at, updated_at
            FROM pilots""",
            """INSERT INTO jobs (key, kind, deployment, idx, spec, state, job_id, reason,
                created_at, updated_at)
            SELECT unit_id, 'unit', deployment, idx, spec, state, job_id, reason, created_at,
                updated_at
            FROM units""",
            "DROP TABLE pilots",
            "DROP TABLE units",
        ],
    )
)

# 14: a reservation of a replica across nodes holds GPUs on every node of its set.
MIGRATIONS.append((14, ["ALTER TABLE reservations ADD COLUMN also TEXT NOT NULL DEFAULT ''"]))


class AdapterRow(SQLModel, table=True):
    """A LoRA adapter served on a deployment's replicas by its name (xhpc.records.AdapterRecord)."""

    __tablename__ = "adapters"

    name: str = Field(primary_key=True)
    base: str = Field(index=True)  # the deployment whose replicas load it
    path: str  # its directory, as checked (xhpc.adapters)
    owner: str
    digest: str  # its directory's content digest (xhpc.weights.tree_digest), for the ledger
    size_bytes: int = 0
    created_at: datetime
    base_created_at: datetime


# 15: LoRA adapters on deployments.
MIGRATIONS.append(
    (
        15,
        [
            """CREATE TABLE adapters (
                name TEXT PRIMARY KEY, base TEXT NOT NULL, path TEXT NOT NULL,
                owner TEXT NOT NULL, digest TEXT NOT NULL, size_bytes INTEGER NOT NULL DEFAULT 0,
                created_at TIMESTAMP NOT NULL, base_created_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_adapters_base ON adapters(base)",
        ],
    )
)

# 16: a deployment asleep by its scaling policy (0 replicas, still served).
MIGRATIONS.append((16, ["ALTER TABLE deployments ADD COLUMN sleeping BOOLEAN NOT NULL DEFAULT 0"]))


class LeaseRow(SQLModel, table=True):
    """A lease on the state (xhpc.store.lease): its holder, its fencing token (one more at each
    new holder) and when it runs out unless renewed."""

    __tablename__ = "leases"

    name: str = Field(primary_key=True)
    holder: str
    token: int
    expires_at: datetime
    acquired_at: datetime


# 17: the leader's lease (active and standby brokers on one database).
MIGRATIONS.append(
    (
        17,
        [
            """CREATE TABLE leases (
                name TEXT PRIMARY KEY, holder TEXT NOT NULL, token INTEGER NOT NULL,
                expires_at TIMESTAMP NOT NULL, acquired_at TIMESTAMP NOT NULL)""",
        ],
    )
)


class SecretRow(SQLModel, table=True):
    """A secret the brokers of one state share and nothing else reads (the relay's key:
    xhpc.broker.relay): kept in the database, which jobs do not reach."""

    __tablename__ = "secrets"

    name: str = Field(primary_key=True)
    value: str


# 18: secrets the brokers share (the relay between login nodes).
MIGRATIONS.append((18, ["CREATE TABLE secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL)"]))

SCHEMA_VERSION = MIGRATIONS[-1][0]
