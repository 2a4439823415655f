"""LoRA adapters in the store (``xhpc.store.adapters``): added once by name, listed by base,
removed; a write the routing table's cache sees."""

from __future__ import annotations

from pathlib import Path

import pytest

from xhpc.clock import utcnow
from xhpc.errors import NotFoundError, ValidationError
from xhpc.records import AdapterRecord
from xhpc.store import Store
from xhpc.store.adapters import Adapters


def _adapter(name: str, base: str = "llama") -> AdapterRecord:
    now = utcnow()
    return AdapterRecord(name=name, base=base, path=f"/a/{name}", owner="ann", digest="d" * 64,
                         created_at=now, base_created_at=now)  # fmt: skip


def test_adapters_are_added_once_listed_by_base_and_removed(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    adapters = Adapters(store)
    before = store.writes
    for name, base in (("b1", "llama"), ("a1", "llama"), ("q1", "qwen")):
        adapters.add(_adapter(name, base))
    assert store.writes > before  # the routing table is made again after such a write
    assert [a.name for a in adapters.all()] == ["a1", "b1", "q1"]
    got = adapters.get("a1")
    assert got.base_created_at.tzinfo is not None and got.size_bytes == 0
    assert [a.name for a in adapters.all(base="llama")] == ["a1", "b1"]
    q1 = adapters.get("q1")
    times = {"created_at": q1.created_at, "base_created_at": q1.base_created_at}
    assert q1 == _adapter("q1", "qwen").model_copy(update=times)
    with pytest.raises(ValidationError, match="exists"):
        adapters.add(_adapter("a1", "qwen"))
    assert adapters.remove("a1").base == "llama"
    with pytest.raises(NotFoundError):
        adapters.get("a1")
    with pytest.raises(NotFoundError):
        adapters.remove("a1")
    assert [a.name for a in Adapters(Store(tmp_path / "x.db")).all()] == ["b1", "q1"]
