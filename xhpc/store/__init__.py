"""State store (SQLite through sqlmodel)."""

from xhpc.store.store import Store, replica_view
from xhpc.store.tables import DeploymentRow, EventRow, JobRow, ReplicaRow, ReservationRow

__all__ = [
    "DeploymentRow",
    "EventRow",
    "JobRow",
    "ReplicaRow",
    "ReservationRow",
    "Store",
    "replica_view",
]
