"""The state store: the only code that touches SQL. The broker is its only writer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, col, select

from xhpc.changes import NO_CHANGE, DeploymentChange, JobRunChange, ReplicaChange
from xhpc.clock import aware, utcnow
from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import (
    DeploymentView,
    ReplicaState,
    Reservation,
    ServeRequest,
)
from xhpc.records import DeploymentRecord, EventRecord, JobRunRecord, ReplicaRecord
from xhpc.states import ACTIVE, TERMINAL, check_transition
from xhpc.store.engine import SchemaTooNewError, open_engine
from xhpc.store.rows import (
    as_record,
    deployment_record,
    deployment_row,
    indexes_text,
    replica_record,
    replica_row,
)
from xhpc.store.tables import (
    MIGRATIONS,
    SCHEMA_VERSION,
    DeploymentRow,
    EventRow,
    JobRunRow,
    ReplicaRow,
    ReservationRow,
)

log = logging.getLogger(__name__)


_WROTE = "xhpc_wrote"
_FLUSHED = "xhpc_flushed"  # the session wrote something (its lease fence is checked)
# The tables the proxies' routing table is made of (``jobs``: a PD unit's state gates its
# instances), and their columns it never reads: a write to another table (usage, events, keys,
# job_runs) or of those columns only (an agent's heartbeat) never wakes their long-poll, so
# neither a busy batch tenant nor the heartbeats make it recompute.
ROUTE_TABLES = frozenset({"deployments", "replicas", "jobs", "adapters"})
UNROUTED_COLUMNS = frozenset({"last_heartbeat", "updated_at", "devices"})  # a pilot's GPUs


def _changes_routes(row: object, changed: bool) -> bool:
    """Whether writing ``row`` (``changed``: an update, else an insert or a delete) may change
    the routing table."""
    if getattr(row, "__tablename__", None) not in ROUTE_TABLES:
        return False
    if not changed:
        return True
    return any(
        attr.history.has_changes()
        for attr in sa_inspect(row).attrs
        if attr.key not in UNROUTED_COLUMNS
    )


@event.listens_for(Session, "after_flush")
def _flushed(session: Session, _context: Any) -> None:
    if session.new or session.dirty or session.deleted:
        session.info[_FLUSHED] = True
    if (
        any(_changes_routes(row, False) for row in (*session.new, *session.deleted))
        or any(_changes_routes(row, True) for row in session.dirty)
    ):  # fmt: skip
        session.info[_WROTE] = True


class Store:
    """The state: SQLite at a path (the default: one login node), or a PostgreSQL database at a
    URL (brokers on two login nodes), through the same tables, queries and migrations."""

    def __init__(self, db: Path | str) -> None:
        self.db_path = db  # a path (SQLite) or a URL (a server database), for messages
        # Committed sessions that wrote to a table of ROUTE_TABLES: a waiter compares two
        # readings to learn, without a query, that the routes may have changed (the proxies'
        # route long-poll).
        self.writes = 0
        # Set by a broker that leads by a lease: raises FencedError once it is not the leader.
        self.fence: Callable[[Session], None] | None = None
        self.engine: Engine = open_engine(db)
        try:
            self.migrate()
        except SchemaTooNewError:
            self.engine.dispose()
            raise

    # -- schema -----------------------------------------------------------------------------
    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)"))
            row = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar()
            conn.commit()
            return int(row or 0)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def migrate(self) -> int:
        """Bring the schema up to this code's version. A database from a newer xhpc is refused
        (SchemaTooNewError) before anything is written to it. A new server database starts at
        this version from the table definitions (no server database predates them; a migration
        added after it runs on both kinds, and a test checks that both end with the same
        tables and columns)."""
        current = self.schema_version()
        if current > SCHEMA_VERSION:
            raise SchemaTooNewError(self.db_path, current, SCHEMA_VERSION)
        if self.dialect != "sqlite" and current == 0:
            with self.engine.begin() as conn:
                SQLModel.metadata.create_all(conn)
                conn.execute(text("INSERT INTO schema_version VALUES (:v)"), {"v": SCHEMA_VERSION})
            log.info("state store created at schema version %d", SCHEMA_VERSION)
            return SCHEMA_VERSION
        for version, statements in MIGRATIONS:
            if version <= current:
                continue
            with self.engine.begin() as conn:
                for stmt in statements:
                    conn.execute(text(stmt))
                conn.execute(text("INSERT INTO schema_version VALUES (:v)"), {"v": version})
            log.info("state store migrated to schema version %d", version)
            current = version
        return current

    def journal_mode(self) -> str:
        with self.engine.connect() as conn:
            return str(conn.execute(text("PRAGMA journal_mode")).scalar())

    @contextmanager
    def session(self, fenced: bool = True) -> Iterator[Session]:
        """A transaction: committed at the end of the block, rolled back if it raises. With a
        ``fence`` (a broker that leads by a lease, xhpc.store.lease), it is checked in the
        transaction, after its writes, before the commit (``fenced=False``: the lease's own)."""
        with Session(self.engine, expire_on_commit=False) as session:
            yield session
            if fenced and self.fence is not None:
                session.flush()
                if session.info.pop(_FLUSHED, False):  # a read-only session needs no fence
                    self.fence(session)
            session.commit()
            if session.info.pop(_WROTE, False):
                self.writes += 1

    # -- deployments and replicas -----------------------------------------------------------
    def create_deployment(
        self,
        record: DeploymentRecord,
        replicas: Sequence[ReplicaRecord],
        reservations: Sequence[Reservation] = (),
    ) -> None:
        """Write the deployment, its replicas (in CREATING) and their GPU reservations in one
        transaction: concurrent launches see each other's reservations before Slurm does."""
        dep = deployment_row(record)
        with self.session() as s:
            existing = s.get(DeploymentRow, dep.name)
            if existing is not None:
                active = s.exec(
                    select(ReplicaRow).where(
                        ReplicaRow.deployment == dep.name,
                        col(ReplicaRow.state).in_([st.value for st in ACTIVE]),
                    )
                ).first()
                if active is not None:
                    raise ValidationError(
                        f"deployment {dep.name!r} is already running",
                        hint=f"use `xhpc stop {dep.name}` first, or --name for another one",
                    )
                for field in (
                    "model",
                    "model_path",
                    "engine",
                    "gpus",
                    "partition",
                    "time_limit",
                    "nodelist",
                    "engine_args",
                    "created_at",
                    "gpu_type",
                    "pilot_node",
                    "owner",
                    "account",
                    "pd",
                    "prefill_gpus",
                    "decode_gpus",
                    "prefill_args",
                    "decode_args",
                    "request",
                    "wanted",
                    "restart",
                    "until_at",
                    "failed_reason",
                ):
                    setattr(existing, field, getattr(dep, field))
                existing.stopped_at = None
                s.add(existing)
            else:
                s.add(dep)
            s.flush()
            self._add_replicas(s, dep.name, replicas, reservations)

    def add_replicas(
        self,
        deployment: str,
        replicas: Sequence[ReplicaRecord],
        reservations: Sequence[Reservation] = (),
    ) -> None:
        """More replicas (in CREATING) for a running deployment, with their reservations."""
        with self.session() as s:
            dep = s.get(DeploymentRow, deployment)
            if dep is None:
                raise NotFoundError(f"no deployment named {deployment!r}")
            dep.stopped_at = None
            s.add(dep)
            self._add_replicas(s, deployment, replicas, reservations)

    def _add_replicas(
        self,
        s: Session,
        deployment: str,
        replicas: Sequence[ReplicaRecord],
        reservations: Sequence[Reservation],
    ) -> None:
        for rec in replicas:
            s.add(replica_row(rec.model_copy(update={"state": ReplicaState.CREATING})))
            s.add(self._event(rec.replica_id, deployment, "state", "CREATING"))
        s.flush()
        for res in reservations:
            s.add(
                ReservationRow(
                    replica_id=res.replica_id,
                    node=res.node,
                    gpus=res.gpus,
                    created_at=res.created_at,
                    also=",".join(res.also),
                )
            )

    def next_replica_index(self, deployment: str) -> int:
        with self.session() as s:
            rows = s.exec(select(ReplicaRow.idx).where(ReplicaRow.deployment == deployment)).all()
            return max(rows, default=-1) + 1

    def get_deployment(self, name: str) -> DeploymentRecord:
        with self.session() as s:
            row = s.get(DeploymentRow, name)
            if row is None:
                raise NotFoundError(f"no deployment named {name!r}")
            return deployment_record(row)

    def live_deployment(self, name: str) -> DeploymentRecord | None:
        """Deployment ``name`` when it exists and has not stopped."""
        with self.session() as s:
            row = s.get(DeploymentRow, name)
            return None if row is None or row.stopped_at is not None else deployment_record(row)

    def deployments(self) -> list[DeploymentRecord]:
        with self.session() as s:
            return [deployment_record(row) for row in s.exec(select(DeploymentRow)).all()]

    def replica(self, replica_id: str) -> ReplicaRecord:
        with self.session() as s:
            row = s.get(ReplicaRow, replica_id)
            if row is None:
                raise NotFoundError(f"no replica named {replica_id!r}")
            return replica_record(row)

    def replicas(
        self, *, deployment: str | None = None, active_only: bool = False
    ) -> list[ReplicaRecord]:
        with self.session() as s:
            q = select(ReplicaRow)
            if deployment is not None:
                q = q.where(ReplicaRow.deployment == deployment)
            if active_only:
                q = q.where(col(ReplicaRow.state).in_([st.value for st in ACTIVE]))
            q = q.order_by(col(ReplicaRow.deployment), col(ReplicaRow.idx))
            return [replica_record(row) for row in s.exec(q).all()]

    def deployment_view(self, name: str) -> DeploymentView:
        dep = self.get_deployment(name)
        return DeploymentView(
            name=dep.name,
            model=dep.model,
            model_path=dep.model_path,
            engine=dep.engine,
            gpus=dep.gpus,
            replicas=tuple(r.view() for r in self.replicas(deployment=name)),
            wanted=dep.wanted,
            restart=dep.restart,
            stopped=dep.stopped_at is not None,
            failed_reason=dep.failed_reason,
            scaling=ServeRequest.model_validate_json(dep.request).scaling if dep.request else None,
        )

    def update_replica(self, replica_id: str, change: ReplicaChange) -> ReplicaRecord:
        """Apply ``change`` (what it sets, nothing else) to the replica's row."""
        with self.session() as s:
            row = s.get(ReplicaRow, replica_id)
            if row is None:
                raise NotFoundError(f"no replica named {replica_id!r}")
            left = row.job_id
            _apply_change(row, change)
            row.updated_at = utcnow()
            s.add(row)
            self._close_left_job(s, row, left)
            return replica_record(row)

    def transition(
        self,
        replica_id: str,
        target: ReplicaState,
        reason: str | None = None,
        change: ReplicaChange = NO_CHANGE,
    ) -> ReplicaRecord:
        """Move a replica to ``target`` (validated), record an event and apply ``change``, in
        one transaction."""
        with self.session() as s:
            row = s.get(ReplicaRow, replica_id)
            if row is None:
                raise NotFoundError(f"no replica named {replica_id!r}")
            current = ReplicaState(row.state)
            if current != target:
                check_transition(replica_id, current, target)
                row.state = target.value
                msg = target.value if not reason else f"{target.value}: {reason}"
                s.add(self._event(replica_id, row.deployment, "state", msg))
                log.info(
                    "transition replica=%s deployment=%s from=%s to=%s job=%s reason=%s",
                    replica_id,
                    row.deployment,
                    current.value,
                    target.value,
                    change.job_id if "job_id" in change.model_fields_set else row.job_id,
                    json.dumps(reason),
                )
            left = row.job_id
            row.reason = reason
            _apply_change(row, change)
            row.updated_at = utcnow()
            s.add(row)
            self._close_left_job(s, row, left)
            return replica_record(row)

    def update_deployment(self, name: str, change: DeploymentChange) -> DeploymentRecord:
        with self.session() as s:
            row = s.get(DeploymentRow, name)
            if row is None:
                raise NotFoundError(f"no deployment named {name!r}")
            for key, value in change.given().items():
                setattr(row, key, value)
            s.add(row)
            return deployment_record(row)

    def mark_deployment_stopped(self, name: str) -> None:
        with self.session() as s:
            row = s.get(DeploymentRow, name)
            if row is not None and row.stopped_at is None:
                row.stopped_at = utcnow()
                s.add(row)
                log.info(
                    "transition deployment=%s to=%s reason=%s",
                    name,
                    "FAILED" if row.failed_reason else "ENDED",
                    json.dumps(row.failed_reason),
                )

    # -- reservations ------------------------------------------------------------------------
    def open_reservations(self) -> list[Reservation]:
        with self.session() as s:
            rows = s.exec(
                select(ReservationRow).where(col(ReservationRow.released_at).is_(None))
            ).all()
            return [
                Reservation(
                    replica_id=r.replica_id,
                    node=r.node,
                    gpus=r.gpus,
                    created_at=aware(r.created_at) or utcnow(),
                    also=tuple(n for n in r.also.split(",") if n),
                )
                for r in rows
            ]

    def move_reservation(self, replica_id: str, node: str, gpus: int) -> None:
        """Point a replica's reservation at another node (a re-plan), open again from now."""
        with self.session() as s:
            row = s.get(ReservationRow, replica_id)
            if row is None:
                row = ReservationRow(
                    replica_id=replica_id, node=node, gpus=gpus, created_at=utcnow()
                )
            row.node, row.gpus, row.created_at, row.also = node, gpus, utcnow(), ""
            row.released_at, row.release_reason = None, None
            s.add(row)

    def release_reservation(self, replica_id: str, reason: str) -> bool:
        """Release an open reservation; False when there was none."""
        with self.session() as s:
            row = s.get(ReservationRow, replica_id)
            if row is None or row.released_at is not None:
                return False
            row.released_at = utcnow()
            row.release_reason = reason
            s.add(row)
            s.add(self._event(replica_id, None, "reservation", f"released: {reason}"))
            return True

    # -- jobs and events --------------------------------------------------------------------
    def record_job(self, run: JobRunRecord) -> JobRunRecord:
        """Record a run of a replica's job (a new row: Slurm's ids restart, so another
        replica's row may carry the same job id). Recording a run that is already recorded and
        still open keeps that row (an adoption may find a job that was recorded)."""
        with self.session() as s:
            current = self._job_row(s, run.replica_id, run.job_id)
            if current is not None and current.ended_at is None:
                return as_record(JobRunRecord, current)
            row = JobRunRow(**run.model_dump(exclude={"id"}))
            s.add(row)
            s.flush()
            return as_record(JobRunRecord, row)

    def update_job(self, replica_id: str, job_id: str, change: JobRunChange) -> None:
        """Update the replica's newest row for ``job_id``; nothing when it has none."""
        with self.session() as s:
            row = self._job_row(s, replica_id, job_id)
            if row is None:
                return
            for key, value in change.given().items():
                setattr(row, key, value)
            s.add(row)

    def end_job(self, replica_id: str, job_id: str, slurm_state: str | None = None) -> None:
        """Close the replica's row for ``job_id`` (if still open), with Slurm's final state
        when it is known."""
        with self.session() as s:
            self._end_job(s, replica_id, job_id, slurm_state)

    def job(self, replica_id: str, job_id: str) -> JobRunRecord | None:
        """The replica's own (newest) run of ``job_id``: never another replica's job."""
        with self.session() as s:
            row = self._job_row(s, replica_id, job_id)
            return as_record(JobRunRecord, row) if row is not None else None

    def submitted_at(self, replica_id: str, job_id: str) -> datetime | None:
        """When the replica's (newest) run of ``job_id`` was submitted; None: not recorded."""
        job = self.job(replica_id, job_id)
        return job.submitted_at if job is not None else None

    def jobs(
        self, *, replica_id: str | None = None, job_id: str | None = None
    ) -> list[JobRunRecord]:
        """Job rows, oldest first: of one replica, or every row that carries ``job_id``."""
        with self.session() as s:
            q = select(JobRunRow)
            if replica_id is not None:
                q = q.where(JobRunRow.replica_id == replica_id)
            if job_id is not None:
                q = q.where(JobRunRow.job_id == job_id)
            return [as_record(JobRunRecord, r) for r in s.exec(q.order_by(col(JobRunRow.id)))]

    @staticmethod
    def _job_row(s: Session, replica_id: str, job_id: str) -> JobRunRow | None:
        q = select(JobRunRow).where(JobRunRow.replica_id == replica_id, JobRunRow.job_id == job_id)
        return s.exec(q.order_by(col(JobRunRow.id).desc()).limit(1)).first()

    def _close_left_job(self, s: Session, row: ReplicaRow, left: str | None) -> None:
        """Close the row of job ``left`` once ``row`` has left it: the replica records another
        job now (a re-plan, an adoption), or none, or it has ended. (Reconcile closes rows too,
        with Slurm's final state, when it sees a job end or vanish.)"""
        if left is not None and (row.job_id != left or ReplicaState(row.state) in TERMINAL):
            self._end_job(s, row.replica_id, left, None)

    def _end_job(self, s: Session, replica_id: str, job_id: str, slurm_state: str | None) -> None:
        job = self._job_row(s, replica_id, job_id)
        if job is None or job.ended_at is not None:
            return
        job.ended_at = utcnow()
        if slurm_state is not None:
            job.slurm_state = slurm_state
        s.add(job)

    def add_event(
        self, replica_id: str | None, deployment: str | None, kind: str, msg: str
    ) -> None:
        with self.session() as s:
            s.add(self._event(replica_id, deployment, kind, msg))

    def events(self, replica_id: str | None = None, limit: int = 100) -> list[EventRecord]:
        """The last ``limit`` events (of one replica), oldest first."""
        with self.session() as s:
            q = select(EventRow)
            if replica_id is not None:
                q = q.where(EventRow.replica_id == replica_id)
            q = q.order_by(col(EventRow.id).desc()).limit(limit)
            return [as_record(EventRecord, row) for row in reversed(s.exec(q).all())]

    @staticmethod
    def _event(replica_id: str | None, deployment: str | None, kind: str, msg: str) -> EventRow:
        return EventRow(
            at=utcnow(), replica_id=replica_id, deployment=deployment, kind=kind, message=msg
        )


def state_event(kind: str, name: str, current: str, target: str, reason: str | None) -> EventRow:
    """A pilot's or a PD unit's state change: one event row and one structured log line."""
    log.info(
        "transition %s=%s from=%s to=%s reason=%s", kind, name, current, target, json.dumps(reason)
    )
    msg = f"{kind} {name}: {target}" + (f": {reason}" if reason else "")
    return EventRow(at=utcnow(), replica_id=None, deployment=None, kind=kind, message=msg)


def _apply_change(row: ReplicaRow, change: ReplicaChange) -> None:
    """Set what ``change`` gives on ``row`` (GPU indexes as the column keeps them). A replica
    given another job (re-planned, adopted) expects that job's first run again: the requeue
    counter it checks agents against starts over, unless the change sets it too."""
    given = change.given()
    if "job_id" in given and given["job_id"] != row.job_id and "restarts" not in given:
        given["restarts"] = 0
    if "gpus" in given:
        given["gpus"] = indexes_text(given["gpus"])
    for key, value in given.items():
        setattr(row, key, value)
