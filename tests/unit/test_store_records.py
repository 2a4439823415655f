"""Rows read back as the broker's typed records: enums, tuples and UTC-aware timestamps, from a
real SQLite file (which gives timestamps back naive)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

import xhpc
from xhpc.changes import ReplicaChange
from xhpc.models import (
    EngineKind,
    PdRole,
    PilotState,
    ReplicaState,
    ReplicaView,
    RestartPolicy,
    UnitState,
)
from xhpc.records import DeploymentRecord, JobRunRecord, PilotRecord, ReplicaRecord, UnitRecord
from xhpc.store import Store, deployment_record, tables
from xhpc.store.pilots import Pilots
from xhpc.store.units import Units

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "xhpc.db")
    dep = DeploymentRecord(
        name="m",
        model="m",
        model_path="/models/m",
        engine=EngineKind.VLLM,
        gpus=2,
        engine_args=("--max-model-len", "4096"),
        prefill_args=("--p",),
        created_at=T0,
        restart=RestartPolicy.ON_FAILURE,
        until_at=T0,
        wanted=3,
    )
    replica = ReplicaRecord(
        replica_id="m-0",
        deployment="m",
        index=0,
        state=ReplicaState.QUEUED,
        engine=EngineKind.VLLM,
        created_at=T0,
        updated_at=T0,
    )
    s.create_deployment(dep, [replica])
    return s


def test_a_deployment_reads_back_typed(store: Store) -> None:
    dep = deployment_record(store.get_deployment("m"))
    assert isinstance(dep, DeploymentRecord)
    assert (dep.engine, dep.restart) == (EngineKind.VLLM, RestartPolicy.ON_FAILURE)
    assert dep.engine_args == ("--max-model-len", "4096")
    assert (dep.prefill_args, dep.decode_args) == (("--p",), ())
    assert dep.created_at == T0 and dep.until_at == T0  # aware again
    assert (dep.wanted, dep.stopped_at) == (3, None)


def test_a_pilot_reads_back_typed_and_its_heartbeat_keeps_its_devices(store: Store) -> None:
    pilots = Pilots(store)
    pilots.add(
        PilotRecord(
            pilot_id="pilot-1",
            node="n1",
            gpus=4,
            state=PilotState.PENDING,
            job_id="7",
            token_hash="digest-of-the-token",
            pilot_dir="/p",
            created_at=T0,
            updated_at=T0,
        )
    )
    before = pilots.get("pilot-1")
    assert isinstance(before, PilotRecord)
    assert (before.state, before.devices, before.created_at) == (PilotState.PENDING, (), T0)
    assert "digest-of-the-token" not in repr(before) and "token_hash" not in before.model_dump()
    pilots.heard("pilot-1", (0, 3), PilotState.RUNNING)
    after = pilots.get("pilot-1")
    assert (after.state, after.devices) == (PilotState.RUNNING, (0, 3))
    assert after.last_heartbeat is not None and after.last_heartbeat.tzinfo is not None
    assert pilots.view(after).devices == (0, 3)


def test_a_unit_reads_back_typed(store: Store) -> None:
    units = Units(store)
    units.add(
        [
            UnitRecord(
                unit_id="m-u2",
                deployment="m",
                index=2,
                spec="1P1D",
                state=UnitState.DEGRADED,
                reason="m-u2-p0 is FAILED",
                created_at=T0,
                updated_at=T0,
            )
        ]
    )
    unit = units.get("m-u2")
    assert unit == UnitRecord(
        unit_id="m-u2",
        deployment="m",
        index=2,
        spec="1P1D",
        state=UnitState.DEGRADED,
        reason="m-u2-p0 is FAILED",
        created_at=T0,
        updated_at=T0,
    )


def test_a_jobs_run_is_recorded_and_read_back_as_a_frozen_record(store: Store) -> None:
    run = JobRunRecord(job_id="41", replica_id="m-0", slurm_state="PENDING", submitted_at=T0)
    written = store.record_job(run)
    assert written.id is not None and written.model_copy(update={"id": None}) == run
    assert store.job("m-0", "41") == written == store.jobs(replica_id="m-0")[0]
    assert store.submitted_at("m-0", "41") == T0  # aware again
    assert store.submitted_at("m-0", "42") is None
    with pytest.raises(ValidationError):
        written.slurm_state = "RUNNING"  # type: ignore[misc]


def test_a_replica_leaves_the_store_as_a_frozen_record_that_dumps_as_its_view(
    store: Store,
) -> None:
    store.transition("m-0", ReplicaState.QUEUED)
    store.transition(
        "m-0",
        ReplicaState.STARTING,
        change=ReplicaChange(node="n1", gpus=(0, 2), served_model="served", agent_port=7),
    )
    (listed,) = store.replicas(deployment="m")
    found = store.replica("m-0")
    assert isinstance(found, ReplicaRecord) and found == listed
    assert (found.state, found.gpus, found.created_at) == (ReplicaState.STARTING, (0, 2), T0)
    assert (found.served_model, found.agent_port) == ("served", 7)
    with pytest.raises(ValidationError):
        found.node = "n2"  # type: ignore[misc]
    view = found.view()
    assert type(view) is ReplicaView
    # What only the broker reads (the engine's secret, the agent's token) never leaves with it.
    assert found.model_dump() == view.model_dump()
    assert found.model_dump_json() == view.model_dump_json()


def test_a_new_replica_is_written_from_its_record_and_reads_back_equal(store: Store) -> None:
    new = ReplicaRecord(
        replica_id="m-1",
        deployment="m",
        index=1,
        state=ReplicaState.QUEUED,  # a new replica is CREATING, whatever its record says
        engine=EngineKind.VLLM,
        role=PdRole.DECODE,
        unit="m-u0",
        pinned=(1, 3),
        gpus_asked=2,
        served_model="served",
        token_hash="digest",
        engine_secret="secret",
        replica_dir="/r",
        created_at=T0,
        updated_at=T0,
    )
    store.add_replicas("m", [new])
    found = store.replica("m-1")
    assert found == new.model_copy(update={"state": ReplicaState.CREATING})
    assert (found.token_hash, found.engine_secret) == ("digest", "secret")


def test_no_module_outside_the_store_builds_or_imports_a_row() -> None:
    """Rows stay inside xhpc/store: what crosses its face is records and typed changes."""
    package = Path(xhpc.__file__).parent
    rows = re.compile(r"\b(" + "|".join(n for n in dir(tables) if n.endswith("Row")) + r")\b")
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.relative_to(package).parts[0] != "store"
        and (rows.search(path.read_text()) or "xhpc.store.tables" in path.read_text())
    ]
    assert offenders == []
