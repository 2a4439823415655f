"""The one jobs table: pilots and PD units are jobs of one table and one state machine, and a
database written before it (pilots and units in tables of their own) is migrated forward."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from xhpc.errors import NotFoundError, StateTransitionError
from xhpc.models import JobKind, JobState, PilotState, UnitState
from xhpc.records import JobRecord
from xhpc.store import Store
from xhpc.store.jobs import Jobs
from xhpc.store.pilots import Pilots
from xhpc.store.tables import MIGRATIONS, SCHEMA_VERSION
from xhpc.store.units import Units

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _sql_time(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")


def _version_12_database(db: Path) -> None:
    """What schema version 12 wrote: a pilot and a PD unit, each in a table of its own, and the
    runs of a replica's own job in ``jobs``."""
    db.parent.mkdir(parents=True, exist_ok=True)
    t0, t1 = _sql_time(T0), _sql_time(T0 + timedelta(minutes=5))
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER)")
        for version, statements in MIGRATIONS:
            if version <= 12:
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
        conn.execute(
            "INSERT INTO deployments (name, model, model_path, engine, gpus, created_at, pd)"
            " VALUES ('m', 'm', '/models/m', 'vllm', 1, ?, '1P1D')",
            (t0,),
        )
        conn.execute(
            "INSERT INTO replicas (replica_id, deployment, idx, state, engine, job_id, pilot_id,"
            " pd_unit, created_at, updated_at) VALUES"
            " ('m-0', 'm', 0, 'QUEUED', 'vllm', '7', 'pilot-1', NULL, ?, ?),"
            " ('m-u0-p0', 'm', 1, 'READY', 'vllm', '9+0', NULL, 'm-u0', ?, ?),"
            " ('m-u0-d0', 'm', 2, 'READY', 'vllm', '9+1', NULL, 'm-u0', ?, ?),"
            " ('m-3', 'm', 3, 'READY', 'vllm', '11', NULL, NULL, ?, ?)",
            (t0, t1) * 4,
        )
        conn.execute(
            "INSERT INTO pilots (pilot_id, node, gpus, state, job_id, token_hash, pilot_dir,"
            " output_path, devices, reason, created_at, updated_at) VALUES"
            " ('pilot-1', 'n1', 4, 'RUNNING', '7', 'digest', '/state/pilots/pilot-1',"
            " '/out/%j', '0,1,2,3', NULL, ?, ?)",
            (t0, t1),
        )
        conn.execute(
            "INSERT INTO units (unit_id, deployment, idx, spec, job_id, state, reason,"
            " created_at, updated_at) VALUES ('m-u0', 'm', 0, '1P1D', '9', 'READY', NULL, ?, ?)",
            (t0, t1),
        )
        conn.execute(
            "INSERT INTO jobs (job_id, replica_id, slurm_state, output_path, submitted_at)"
            " VALUES ('11', 'm-3', 'RUNNING', '/out/11', ?)",
            (t0,),
        )


def test_a_version_12_database_finds_its_pilots_and_units_in_the_one_jobs_table(
    tmp_path: Path,
) -> None:
    db = tmp_path / "state" / "xhpc.db"
    _version_12_database(db)
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION >= 13
    jobs = Jobs(store)
    (pilot_job,) = jobs.find(JobKind.PILOT)
    assert (pilot_job.key, pilot_job.state, pilot_job.job_id) == ("pilot-1", JobState.RUNNING, "7")
    assert (pilot_job.node, pilot_job.gpus, pilot_job.devices) == ("n1", 4, (0, 1, 2, 3))
    assert pilot_job.job_dir == "/state/pilots/pilot-1" and pilot_job.created_at == T0
    pilot = Pilots(store).get("pilot-1")
    assert (pilot.state, pilot.token_hash, pilot.output_path) == (
        PilotState.RUNNING,
        "digest",
        "/out/%j",
    )
    assert [r.replica_id for r in Pilots(store).replicas("pilot-1")] == ["m-0"]
    (unit,) = Units(store).of("m", live_only=True)
    assert (unit.unit_id, unit.state, unit.spec, unit.job_id) == (
        "m-u0",
        UnitState.READY,
        "1P1D",
        "9",
    )
    assert [r.replica_id for r in Units(store).instances("m-u0")] == ["m-u0-d0", "m-u0-p0"]
    # The runs of replicas' own jobs kept their rows, in their own table now.
    assert [(j.job_id, j.replica_id) for j in store.jobs()] == [("11", "m-3")]
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"jobs", "job_runs"} <= tables and not {"pilots", "units"} & tables


def test_every_kind_moves_through_the_one_machine_within_its_own_states(tmp_path: Path) -> None:
    store = Store(tmp_path / "xhpc.db")
    jobs = Jobs(store)
    jobs.add(
        [
            JobRecord(key="pilot-1", kind=JobKind.PILOT, node="n1", gpus=2,
                      state=JobState.PENDING, created_at=T0, updated_at=T0),
            JobRecord(key="m-u0", kind=JobKind.UNIT, deployment="m", spec="1P1D",
                      state=JobState.STARTING, created_at=T0, updated_at=T0),
        ]
    )  # fmt: skip
    jobs.transition(JobKind.PILOT, "pilot-1", JobState.RUNNING)
    with pytest.raises(StateTransitionError, match="pilot pilot-1"):
        jobs.transition(JobKind.PILOT, "pilot-1", JobState.READY)  # a unit's state, not a pilot's
    jobs.transition(JobKind.UNIT, "m-u0", JobState.DEGRADED, "m-u0-p0 is FAILED")
    jobs.transition(JobKind.UNIT, "m-u0", JobState.ENDED, "degraded")
    with pytest.raises(StateTransitionError, match="PD unit m-u0"):
        jobs.transition(JobKind.UNIT, "m-u0", JobState.READY)
    with pytest.raises(NotFoundError):
        jobs.get(JobKind.UNIT, "pilot-1")  # a key of another kind is not found
    events = [e.message for e in store.events()]
    assert events == ["pilot pilot-1: RUNNING", "unit m-u0: DEGRADED: m-u0-p0 is FAILED",
                      "unit m-u0: ENDED: degraded"]  # fmt: skip


def test_a_placement_and_a_heartbeat_are_commands_of_their_own(tmp_path: Path) -> None:
    store = Store(tmp_path / "xhpc.db")
    jobs = Jobs(store)
    jobs.add([JobRecord(key="pilot-1", kind=JobKind.PILOT, node="n1", gpus=2,
                        state=JobState.PENDING, created_at=T0, updated_at=T0)])  # fmt: skip
    placed = jobs.place(JobKind.PILOT, "pilot-1", "70", "sweep: found by its tag")
    assert (placed.job_id, placed.reason, placed.state) == (
        "70",
        "sweep: found by its tag",
        JobState.PENDING,
    )
    heard = jobs.heard(JobKind.PILOT, "pilot-1", (1, 0), T0, JobState.RUNNING)
    assert (heard.devices, heard.last_heartbeat, heard.state) == ((1, 0), T0, JobState.RUNNING)


def test_a_unit_state_change_wakes_the_proxies_and_a_pilot_heartbeat_does_not(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "xhpc.db")
    jobs = Jobs(store)
    jobs.add([JobRecord(key="pilot-1", kind=JobKind.PILOT, state=JobState.RUNNING,
                        created_at=T0, updated_at=T0),
              JobRecord(key="m-u0", kind=JobKind.UNIT, deployment="m", spec="1P1D",
                        state=JobState.STARTING, created_at=T0, updated_at=T0)])  # fmt: skip
    before = store.writes
    jobs.heard(JobKind.PILOT, "pilot-1", (0, 1), T0)
    jobs.heard(JobKind.PILOT, "pilot-1", (0, 1), T0 + timedelta(seconds=2))
    assert store.writes == before  # the routing table reads no pilot's heartbeat
    jobs.transition(JobKind.UNIT, "m-u0", JobState.READY)  # a unit's state gates its routes
    assert store.writes == before + 1
