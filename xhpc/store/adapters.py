"""LoRA adapters in the store: each a name served on a base deployment's replicas."""

from __future__ import annotations

from sqlmodel import col, select

from xhpc.clock import aware
from xhpc.errors import NotFoundError, ValidationError
from xhpc.records import AdapterRecord
from xhpc.store.store import Store
from xhpc.store.tables import AdapterRow


def _record(row: AdapterRow) -> AdapterRecord:
    return AdapterRecord(
        name=row.name,
        base=row.base,
        path=row.path,
        owner=row.owner,
        digest=row.digest,
        size_bytes=row.size_bytes,
        created_at=aware(row.created_at),
        base_created_at=aware(row.base_created_at),
    )


class Adapters:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, adapter: AdapterRecord) -> None:
        """Record ``adapter``; ValidationError when its name is taken."""
        with self.store.session() as s:
            if s.get(AdapterRow, adapter.name) is not None:
                raise ValidationError(f"adapter {adapter.name!r} exists")
            s.add(AdapterRow(**adapter.model_dump()))

    def get(self, name: str) -> AdapterRecord:
        with self.store.session() as s:
            row = s.get(AdapterRow, name)
            if row is None:
                raise NotFoundError(f"no adapter {name!r}")
            return _record(row)

    def all(self, base: str | None = None) -> list[AdapterRecord]:
        """Every adapter (of ``base``), by name."""
        with self.store.session() as s:
            q = select(AdapterRow)
            if base is not None:
                q = q.where(AdapterRow.base == base)
            return [_record(r) for r in s.exec(q.order_by(col(AdapterRow.name))).all()]

    def remove(self, name: str) -> AdapterRecord:
        """Forget the adapter; NotFoundError when there is none by ``name``."""
        with self.store.session() as s:
            row = s.get(AdapterRow, name)
            if row is None:
                raise NotFoundError(f"no adapter {name!r}")
            gone = _record(row)
            s.delete(row)
        return gone
