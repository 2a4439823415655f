"""Rows and records: how a domain record becomes its table row and back (the columns keep GPU
indexes as text, enums as their values and argument lists as JSON). Only the store uses them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlmodel import SQLModel

from xhpc.clock import aware, utcnow
from xhpc.models import EngineKind, PdRole, ReplicaState
from xhpc.records import DeploymentRecord, ReplicaRecord
from xhpc.store.tables import DeploymentRow, ReplicaRow

M = TypeVar("M", bound=BaseModel)


def indexes(text_value: str) -> tuple[int, ...]:
    """GPU indexes as a column keeps them ("0,2") read back ((0, 2))."""
    return tuple(int(x) for x in text_value.split(",") if x != "")


def indexes_text(values: Sequence[int]) -> str:
    """GPU indexes as a column keeps them: comma-separated."""
    return ",".join(str(v) for v in values)


def replica_record(row: ReplicaRow) -> ReplicaRecord:
    """A replica's row as its frozen record: states and roles as enums, GPU indexes as tuples,
    timestamps UTC-aware."""
    return ReplicaRecord(
        replica_id=row.replica_id,
        deployment=row.deployment,
        index=row.idx,
        state=ReplicaState(row.state),
        engine=EngineKind(row.engine),
        job_id=row.job_id,
        node=row.node,
        host=row.host,
        port=row.port,
        gpus=indexes(row.gpus),
        reason=row.reason,
        created_at=aware(row.created_at) or utcnow(),
        updated_at=aware(row.updated_at) or utcnow(),
        role=PdRole(row.pd_role) if row.pd_role else None,
        unit=row.pd_unit,
        pilot=row.pilot_id,
        restarts=row.restarts,
        last_heartbeat=aware(row.last_heartbeat),
        ready_at=aware(row.ready_at),
        ends_at=aware(row.ends_at),
        successor_of=row.successor_of,
        placed_node=row.placed_node,
        replans=row.replans,
        replica_dir=row.replica_dir,
        pinned=indexes(row.pinned),
        gpus_asked=row.gpus_asked,
        served_model=row.served_model,
        token_hash=row.token_hash,
        engine_secret=row.engine_secret,
        side_channel_port=row.side_channel_port,
        max_model_len=row.max_model_len,
        agent_port=row.agent_port,
    )


def deployment_row(dep: DeploymentRecord) -> DeploymentRow:
    """A deployment's row, from its record (enums and argument lists as the columns keep them)."""
    return DeploymentRow(
        **{
            **dep.model_dump(),
            "engine": dep.engine.value,
            "restart": dep.restart.value,
            "engine_args": dumps_args(dep.engine_args),
            "prefill_args": dumps_args(dep.prefill_args),
            "decode_args": dumps_args(dep.decode_args),
        }
    )


def replica_row(rec: ReplicaRecord) -> ReplicaRow:
    """A new replica's row, from its record (GPU indexes and enums as the columns keep them)."""
    return ReplicaRow(
        replica_id=rec.replica_id,
        deployment=rec.deployment,
        idx=rec.index,
        state=rec.state.value,
        engine=rec.engine.value,
        job_id=rec.job_id,
        node=rec.node,
        host=rec.host,
        port=rec.port,
        gpus=indexes_text(rec.gpus),
        served_model=rec.served_model,
        reason=rec.reason,
        token_hash=rec.token_hash,
        replica_dir=rec.replica_dir,
        last_heartbeat=rec.last_heartbeat,
        placed_node=rec.placed_node,
        replans=rec.replans,
        pilot_id=rec.pilot,
        pinned=indexes_text(rec.pinned),
        gpus_asked=rec.gpus_asked,
        engine_secret=rec.engine_secret,
        pd_role=rec.role.value if rec.role else None,
        pd_unit=rec.unit,
        side_channel_port=rec.side_channel_port,
        max_model_len=rec.max_model_len,
        agent_port=rec.agent_port,
        successor_of=rec.successor_of,
        ready_at=rec.ready_at,
        ends_at=rec.ends_at,
        restarts=rec.restarts,
        created_at=rec.created_at,
        updated_at=rec.updated_at,
    )


def as_record(model: type[M], row: SQLModel, **fields: Any) -> M:
    """``row`` as the domain type ``model``: the columns the model has, validated (enums from
    their values), timestamps UTC-aware (SQLite gives them back naive), and ``fields`` for what a
    column does not hold as is (GPU lists, JSON lists, a column of another name)."""
    columns = {
        name: aware(value) if isinstance(value, datetime) else value
        for name, value in row.model_dump().items()
        if name in model.model_fields
    }
    return model.model_validate({**columns, **fields})


def deployment_record(row: DeploymentRow | DeploymentRecord) -> DeploymentRecord:
    """A deployment's row as its frozen record (a record is itself already)."""
    if isinstance(row, DeploymentRecord):
        return row
    return as_record(
        DeploymentRecord,
        row,
        engine_args=loads_args(row.engine_args),
        prefill_args=loads_args(row.prefill_args),
        decode_args=loads_args(row.decode_args),
    )


def dumps_args(args: Sequence[str]) -> str:
    return json.dumps(list(args))


def loads_args(value: str) -> tuple[str, ...]:
    return tuple(json.loads(value))
