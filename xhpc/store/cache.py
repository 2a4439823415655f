"""The weights cache ledger in the store: the shared model store's copies and node-local ones."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlmodel import col, select

from xhpc.clock import aware, utcnow
from xhpc.store.store import Store
from xhpc.store.tables import CacheCopyRow
from xhpc.weights import CacheCopy, live_users

SHARED = ""  # the node column of the shared store's copies


def _users(text_value: str) -> tuple[str, ...]:
    return tuple(u for u in text_value.split(",") if u)


def _copy(row: CacheCopyRow, alive: Collection[str]) -> CacheCopy:
    users = _users(row.users)
    return CacheCopy(
        model=row.model,
        node=row.node or None,
        path=row.path,
        size_bytes=row.size_bytes,
        digest=row.digest,
        last_used_at=aware(row.last_used_at),
        users=users,
        in_use_by=live_users(users, alive),
    )


class CacheLedger:
    def __init__(self, store: Store) -> None:
        self.store = store

    def copies(
        self, alive: Collection[str] = (), *, model: str | None = None, node: str | None = None
    ) -> list[CacheCopy]:
        """Copies by model then node (shared first); ``alive``: the replica ids alive now."""
        with self.store.session() as s:
            q = select(CacheCopyRow)
            if model is not None:
                q = q.where(CacheCopyRow.model == model)
            if node is not None:
                q = q.where(CacheCopyRow.node == node)
            q = q.order_by(col(CacheCopyRow.model), col(CacheCopyRow.node))
            return [_copy(r, alive) for r in s.exec(q).all()]

    def shared(self, model: str) -> CacheCopy | None:
        with self.store.session() as s:
            row = s.get(CacheCopyRow, (model, SHARED))
            return None if row is None else _copy(row, ())

    def record(
        self,
        model: str,
        node: str | None,
        path: str,
        size_bytes: int,
        digest: str,
        *,
        user: str | None = None,
        used_at: datetime | None = None,
    ) -> None:
        """Add or update a copy (its path, size and digest as found now); ``user``: a replica
        that uses it, added to its users, and then its last use is ``used_at`` (default now)."""
        with self.store.session() as s:
            row = s.get(CacheCopyRow, (model, node or SHARED))
            if row is None:
                row = CacheCopyRow(
                    model=model,
                    node=node or SHARED,
                    path=path,
                    size_bytes=size_bytes,
                    digest=digest,
                    created_at=utcnow(),
                )
            row.path, row.size_bytes, row.digest = path, size_bytes, digest
            if user is not None:
                users = _users(row.users)
                if user not in users:
                    row.users = ",".join((*users, user))
                row.last_used_at = used_at or utcnow()
            s.add(row)

    def forget(self, model: str, node: str | None) -> bool:
        """Drop a copy's row; False when there was none."""
        with self.store.session() as s:
            row = s.get(CacheCopyRow, (model, node or SHARED))
            if row is None:
                return False
            s.delete(row)
            return True
