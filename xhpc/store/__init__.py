"""State store (SQLite through sqlmodel)."""

from xhpc.store.rows import deployment_record, replica_record
from xhpc.store.store import Store
from xhpc.store.tables import DeploymentRow, EventRow, JobRunRow, ReplicaRow, ReservationRow

__all__ = [
    "DeploymentRow",
    "EventRow",
    "JobRunRow",
    "ReplicaRow",
    "ReservationRow",
    "Store",
    "deployment_record",
    "replica_record",
]
