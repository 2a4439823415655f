"""State store (SQLite through sqlmodel)."""

from xhpc.store.store import Store, replica_view
from xhpc.store.tables import DeploymentRow, EventRow, JobRow, ReplicaRow

__all__ = ["DeploymentRow", "EventRow", "JobRow", "ReplicaRow", "Store", "replica_view"]
