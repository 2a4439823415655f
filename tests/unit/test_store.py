"""The state store against a real SQLite file in a temp dir."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from xhpc.changes import JobRunChange, ReplicaChange
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError, StateTransitionError, ValidationError
from xhpc.models import EngineKind, Reservation
from xhpc.models import ReplicaState as S
from xhpc.records import DeploymentRecord, JobRunRecord, ReplicaRecord
from xhpc.store import Store
from xhpc.store.tables import MIGRATIONS, SCHEMA_VERSION

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def dep_row(name: str = "m") -> DeploymentRecord:
    return DeploymentRecord(
        name=name,
        model=name,
        model_path=f"/models/{name}",
        engine=EngineKind.VLLM,
        gpus=1,
        created_at=T0,
    )


def rep_rows(dep: str = "m", indexes: range = range(2), state: S = S.QUEUED) -> list[ReplicaRecord]:
    # The store must write CREATING whatever state the caller passes.
    return [
        ReplicaRecord(
            replica_id=f"{dep}-{i}",
            deployment=dep,
            index=i,
            state=state,
            engine=EngineKind.VLLM,
            created_at=T0,
            updated_at=T0,
        )
        for i in indexes
    ]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sub" / "xhpc.db"


@pytest.fixture
def store(db: Path) -> Store:
    return Store(db)


def test_wal_mode_and_schema_version(store: Store, db: Path) -> None:
    assert db.exists()
    assert store.journal_mode().lower() == "wal"
    assert store.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        versions = conn.execute("SELECT version FROM schema_version").fetchall()
    assert {"deployments", "replicas", "jobs", "job_runs", "events", "reservations"} <= tables
    assert {"api_keys", "usage"} <= tables
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


def test_remigrate_is_a_no_op(store: Store, db: Path) -> None:
    store.create_deployment(dep_row(), rep_rows())
    assert store.migrate() == SCHEMA_VERSION
    again = Store(db)  # migrates on open
    assert again.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    assert [r.replica_id for r in again.replicas()] == ["m-0", "m-1"]


def test_a_version_1_database_is_upgraded_in_place(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:  # what the first release wrote
        conn.execute("CREATE TABLE schema_version (version INTEGER)")
        for stmt in MIGRATIONS[0][1]:
            conn.execute(stmt)
        conn.execute("INSERT INTO schema_version VALUES (1)")
    upgraded = Store(db)
    assert upgraded.schema_version() == SCHEMA_VERSION
    upgraded.create_deployment(
        dep_row(),
        rep_rows(),
        [
            Reservation(replica_id="m-0", node="n1", gpus=2, created_at=utcnow()),
        ],
    )
    (res,) = upgraded.open_reservations()
    assert (res.replica_id, res.node, res.gpus) == ("m-0", "n1", 2)
    assert upgraded.release_reservation("m-0", "allocated") is True
    assert upgraded.release_reservation("m-0", "allocated") is False
    assert upgraded.open_reservations() == []


def test_create_deployment_writes_creating_and_events(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    rows = store.replicas(deployment="m")
    assert [(r.replica_id, r.state) for r in rows] == [("m-0", "CREATING"), ("m-1", "CREATING")]
    events = store.events()
    assert [(e.replica_id, e.deployment, e.kind, e.message) for e in events] == [
        ("m-0", "m", "state", "CREATING"),
        ("m-1", "m", "state", "CREATING"),
    ]
    assert store.get_deployment("m").model_path == "/models/m"
    view = store.deployment_view("m")
    assert [r.state for r in view.replicas] == [S.CREATING, S.CREATING]
    assert all(r.created_at.tzinfo is not None for r in view.replicas)


def test_transition_validates_and_records(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    row = store.transition("m-0", S.QUEUED, "submitted", ReplicaChange(job_id="7"))
    assert (row.state, row.reason, row.job_id) == ("QUEUED", "submitted", "7")
    assert store.replica("m-0").job_id == "7"
    assert store.events("m-0")[-1].message == "QUEUED: submitted"
    store.transition("m-0", S.STARTING, change=ReplicaChange(node="n1", gpus=(0, 1)))
    assert store.events("m-0")[-1].message == "STARTING"
    assert store.replica("m-0").gpus == (0, 1)


def test_illegal_transition_changes_nothing(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    before = store.replica("m-0")
    n_events = len(store.events())
    with pytest.raises(StateTransitionError) as info:
        store.transition("m-0", S.READY, "skip ahead", ReplicaChange(node="n9"))
    assert (info.value.current, info.value.target) == ("CREATING", "READY")
    after = store.replica("m-0")
    assert (after.state, after.reason, after.node, after.updated_at) == (
        before.state,
        before.reason,
        before.node,
        before.updated_at,
    )
    assert len(store.events()) == n_events


def test_transition_to_same_state_updates_reason_without_event(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    store.transition("m-0", S.QUEUED, "submitted")
    n_events = len(store.events("m-0"))
    row = store.transition("m-0", S.QUEUED, "Resources")
    assert row.reason == "Resources"
    assert len(store.events("m-0")) == n_events


def test_terminal_replica_cannot_move(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    store.transition("m-0", S.FAILED, "boom")
    with pytest.raises(StateTransitionError):
        store.transition("m-0", S.QUEUED)
    assert store.replica("m-0").state == "FAILED"


def test_unknown_names_are_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.transition("nope-0", S.QUEUED)
    with pytest.raises(NotFoundError):
        store.replica("nope-0")
    with pytest.raises(NotFoundError):
        store.get_deployment("nope")
    with pytest.raises(NotFoundError):
        store.update_replica("nope-0", ReplicaChange(node="n1"))


def test_next_replica_index(store: Store) -> None:
    assert store.next_replica_index("m") == 0
    store.create_deployment(dep_row(), rep_rows(indexes=range(3)))
    assert store.next_replica_index("m") == 3
    assert store.next_replica_index("other") == 0


def test_second_active_deployment_with_same_name_is_refused(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    with pytest.raises(ValidationError, match="already running"):
        store.create_deployment(dep_row(), rep_rows(indexes=range(2, 4)))
    assert [r.replica_id for r in store.replicas()] == ["m-0", "m-1"]


def test_same_name_may_be_reused_once_stopped(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    for rid in ("m-0", "m-1"):
        store.transition(rid, S.STOPPED, "user stop")
    store.mark_deployment_stopped("m")
    assert store.get_deployment("m").stopped_at is not None
    new = dep_row().model_copy(update={"model_path": "/models/m-v2"})
    store.create_deployment(new, rep_rows(indexes=range(2, 3)))
    dep = store.get_deployment("m")
    assert (dep.model_path, dep.stopped_at) == ("/models/m-v2", None)
    assert [(r.replica_id, r.state) for r in store.replicas(active_only=True)] == [
        ("m-2", "CREATING")
    ]


def test_replicas_filters(store: Store) -> None:
    store.create_deployment(dep_row("a"), rep_rows("a", range(3)))
    store.create_deployment(dep_row("b"), rep_rows("b", range(1)))
    store.transition("a-1", S.FAILED, "x")
    store.transition("a-2", S.QUEUED)
    store.transition("a-2", S.LOST)  # LOST is still active: it may come back
    assert [r.replica_id for r in store.replicas()] == ["a-0", "a-1", "a-2", "b-0"]
    assert [r.replica_id for r in store.replicas(active_only=True)] == ["a-0", "a-2", "b-0"]
    assert [r.replica_id for r in store.replicas(deployment="a", active_only=True)] == [
        "a-0",
        "a-2",
    ]


def test_events_are_ordered_oldest_first_and_limited(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows(indexes=range(1)))
    for i in range(5):
        store.add_event("m-0", "m", "note", f"n{i}")
    msgs = [e.message for e in store.events("m-0")]
    assert msgs == ["CREATING", "n0", "n1", "n2", "n3", "n4"]
    assert [e.message for e in store.events("m-0", limit=2)] == ["n3", "n4"]
    ids = [e.id or 0 for e in store.events()]
    assert 0 not in ids
    assert ids == sorted(ids)


def job_row(job_id: str, replica_id: str, output: str | None = None) -> JobRunRecord:
    return JobRunRecord(
        job_id=job_id,
        replica_id=replica_id,
        slurm_state="PENDING",
        output_path=output,
        submitted_at=utcnow(),
    )


def test_jobs_record_and_update(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows(indexes=range(1)))
    store.record_job(
        JobRunRecord(job_id="5_0", replica_id="m-0", slurm_state="PENDING", submitted_at=T0)
    )
    store.update_job("m-0", "5_0", JobRunChange(slurm_state="RUNNING", node="n1"))
    store.update_job("m-0", "missing", JobRunChange(slurm_state="RUNNING"))  # ignored
    job = store.job("m-0", "5_0")
    assert job is not None and (job.slurm_state, job.node) == ("RUNNING", "n1")
    assert job.id is not None and job.ended_at is None
    assert store.job("m-0", "missing") is None
    assert store.job("m-1", "5_0") is None  # another replica's lookup never finds it


def test_recording_an_open_run_again_keeps_its_row(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows(indexes=range(1)))
    first = store.record_job(job_row("5", "m-0", "/out/first"))
    again = store.record_job(job_row("5", "m-0", "/out/again"))  # e.g. adopted after a crash
    assert again.id == first.id
    assert [j.output_path for j in store.jobs(replica_id="m-0")] == ["/out/first"]


def test_a_restarted_job_id_keys_two_replicas_apart(store: Store) -> None:
    """After a controller rebuild Slurm's ids restart: two replicas' jobs may share an id."""
    store.create_deployment(dep_row("a"), rep_rows("a", range(1)))
    store.record_job(job_row("5", "a-0", "/out/a"))
    store.transition("a-0", S.QUEUED, "submitted", ReplicaChange(job_id="5"))
    store.transition("a-0", S.FAILED, "job NODE_FAIL")
    store.create_deployment(dep_row("b"), rep_rows("b", range(1)))
    store.record_job(job_row("5", "b-0", "/out/b"))
    store.transition("b-0", S.QUEUED, "submitted", ReplicaChange(job_id="5"))
    store.update_job("b-0", "5", JobRunChange(slurm_state="RUNNING", node="n2"))
    a, b = store.job("a-0", "5"), store.job("b-0", "5")
    assert a is not None and b is not None and a.id != b.id
    assert (a.output_path, a.slurm_state, b.output_path, b.slurm_state) == (
        "/out/a",
        "PENDING",  # b's update never touched a's row
        "/out/b",
        "RUNNING",
    )
    assert a.ended_at is not None and b.ended_at is None
    assert [j.replica_id for j in store.jobs(job_id="5")] == ["a-0", "b-0"]


def test_a_job_row_is_closed_when_its_replica_leaves_the_job(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows())
    for rid, job_id in (("m-0", "7"), ("m-1", "8")):
        store.record_job(job_row(job_id, rid))
        store.transition(rid, S.QUEUED, "submitted", ReplicaChange(job_id=job_id))
    store.update_replica(
        "m-0", ReplicaChange(reason="still waiting")
    )  # the same job: nothing closes
    assert all(j.ended_at is None for j in store.jobs())
    store.record_job(job_row("9", "m-0"))  # re-planned to a new job
    store.update_replica("m-0", ReplicaChange(job_id="9"))
    old, new = store.jobs(replica_id="m-0")
    assert (old.job_id, new.job_id) == ("7", "9")
    assert old.ended_at is not None and new.ended_at is None
    assert old.slurm_state == "PENDING"  # its final state is not known here
    store.transition("m-1", S.STOPPED, "stopped")  # terminal: its job is left
    (stopped,) = store.jobs(replica_id="m-1")
    assert stopped.ended_at is not None
    ended_at = stopped.ended_at
    store.update_replica("m-1", ReplicaChange(reason="again"))  # an ended row keeps its end
    assert store.jobs(replica_id="m-1")[0].ended_at == ended_at


def test_end_job_keeps_the_first_end_and_a_known_state(store: Store) -> None:
    store.create_deployment(dep_row(), rep_rows(indexes=range(1)))
    store.record_job(job_row("7", "m-0"))
    store.end_job("m-0", "7", "CANCELLED")
    job = store.job("m-0", "7")
    assert job is not None and job.slurm_state == "CANCELLED" and job.ended_at is not None
    store.end_job("m-0", "7", "COMPLETED")  # already closed: unchanged
    again = store.job("m-0", "7")
    assert again is not None and (again.slurm_state, again.ended_at) == ("CANCELLED", job.ended_at)
    store.end_job("m-0", "missing")  # nothing to close
    # A run recorded after its row closed is a new run (a re-used id): a new row.
    store.record_job(job_row("7", "m-0"))
    assert [j.ended_at is None for j in store.jobs(replica_id="m-0")] == [False, True]


def _sql_time(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")


def test_a_version_7_database_gets_job_rows_with_their_own_key(db: Path) -> None:
    db.parent.mkdir(parents=True)
    t0, t1 = _sql_time(T0), _sql_time(T0 + timedelta(minutes=5))
    with sqlite3.connect(db) as conn:  # what version 7 wrote: jobs keyed by Slurm's id
        conn.execute("CREATE TABLE schema_version (version INTEGER)")
        for version, statements in MIGRATIONS:
            if version <= 7:
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
        conn.execute(
            "INSERT INTO deployments (name, model, model_path, engine, gpus, created_at)"
            " VALUES ('m', 'm', '/models/m', 'vllm', 1, ?)",
            (t0,),
        )
        replicas = [("m-0", "QUEUED", "14"), ("m-1", "FAILED", "12"), ("m-2", "READY", "15")]
        for i, (rid, state, job_id) in enumerate(replicas):
            conn.execute(
                "INSERT INTO replicas (replica_id, deployment, idx, state, engine, job_id,"
                " created_at, updated_at) VALUES (?, 'm', ?, ?, 'vllm', ?, ?, ?)",
                (rid, i, state, job_id, t0, t1),
            )
        jobs = [
            ("13", "m-0", "PENDING", "/out/13"),  # m-0 was re-planned from 13 to 14
            ("14", "m-0", "PENDING", "/out/14"),
            ("12", "m-1", "RUNNING", "/out/12"),  # m-1 failed: its row stayed RUNNING
            ("15", "m-2", "RUNNING", "/out/15"),
        ]
        for job_id, rid, state, out in jobs:
            conn.execute(
                "INSERT INTO jobs (job_id, replica_id, slurm_state, output_path, submitted_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (job_id, rid, state, out, t0),
            )
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION >= 8
    rows = store.jobs()
    assert [(j.id, j.job_id, j.replica_id, j.output_path) for j in rows] == [
        (1, "12", "m-1", "/out/12"),
        (2, "13", "m-0", "/out/13"),
        (3, "14", "m-0", "/out/14"),
        (4, "15", "m-2", "/out/15"),
    ]
    ended = {j.job_id: j.ended_at and j.ended_at.replace(tzinfo=UTC) for j in rows}
    # Rows of jobs their replicas had left are closed, at the replica's last update.
    assert ended == {"12": T0 + timedelta(minutes=5), "13": T0 + timedelta(minutes=5),
                     "14": None, "15": None}  # fmt: skip
    with sqlite3.connect(db) as conn:
        indexes = {r[1] for r in conn.execute("PRAGMA index_list(job_runs)")}
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"ix_job_runs_job_id", "ix_job_runs_replica_id", "ix_job_runs_run"} <= indexes
    assert "jobs_new" not in tables
    # After a controller rebuild job 15 is handed out again: to another replica, no collision.
    store.add_replicas("m", rep_rows("m", range(3, 4)))
    store.record_job(job_row("15", "m-3", "/out/15-again"))
    again, first = store.job("m-3", "15"), store.job("m-2", "15")
    assert again is not None and first is not None
    assert (again.output_path, first.output_path) == ("/out/15-again", "/out/15")


def test_reopening_keeps_data(db: Path) -> None:
    first = Store(db)
    first.create_deployment(dep_row(), rep_rows())
    first.transition("m-0", S.QUEUED, "submitted", ReplicaChange(job_id="11"))
    hb = T0 + timedelta(minutes=1)
    first.update_replica("m-0", ReplicaChange(last_heartbeat=hb))
    first.engine.dispose()
    second = Store(db)
    row = second.replica("m-0")
    assert (row.state, row.job_id, row.reason) == ("QUEUED", "11", "submitted")
    assert row.last_heartbeat is not None
    assert row.last_heartbeat.replace(tzinfo=UTC) == hb
    assert [e.message for e in second.events("m-0")] == ["CREATING", "QUEUED: submitted"]
    assert second.deployment_view("m").replicas[0].updated_at.tzinfo is not None


def test_a_reservation_across_nodes_keeps_its_set(store: Store) -> None:
    res = Reservation(replica_id="m-0", node="n1", gpus=2, created_at=utcnow(), also=("n2", "n3"))
    store.create_deployment(dep_row(), rep_rows(indexes=range(1)), [res])
    (back,) = store.open_reservations()
    assert back.nodes == ("n1", "n2", "n3") and back.gpus == 2
    store.move_reservation("m-0", "n4", 2)  # a re-plan: one node
    (moved,) = store.open_reservations()
    assert moved.nodes == ("n4",)
