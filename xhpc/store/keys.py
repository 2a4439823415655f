"""API keys and their usage in the store (only key digests are kept)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from sqlmodel import col, select

from xhpc.access import KeyCreate, KeyGrant, KeyView, UsageCount, UsageLine, new_key
from xhpc.clock import utcnow
from xhpc.errors import NotFoundError
from xhpc.store.store import Store
from xhpc.store.tables import ApiKeyRow, UsageRow


def _view(row: ApiKeyRow) -> KeyView:
    return KeyView(
        key_id=row.key_id,
        user=row.user,
        account=row.account,
        admin=row.admin,
        rpm=row.rpm,
        token_quota=row.token_quota,
        max_concurrent=row.max_concurrent,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


class Keys:
    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, req: KeyCreate) -> tuple[KeyView, str]:
        """The new key's view and the key itself (shown once, never stored)."""
        key_id, key, digest = new_key()
        row = ApiKeyRow(
            key_id=key_id,
            secret_hash=digest,
            user=req.user,
            account=req.account,
            admin=req.admin,
            rpm=req.rpm,
            token_quota=req.token_quota,
            max_concurrent=req.max_concurrent,
            created_at=utcnow(),
        )
        with self.store.session() as s:
            s.add(row)
        return _view(row), key

    def all(self) -> list[KeyView]:
        with self.store.session() as s:
            rows = s.exec(select(ApiKeyRow).order_by(col(ApiKeyRow.created_at))).all()
            return [_view(r) for r in rows]

    def view(self, key_id: str) -> KeyView | None:
        with self.store.session() as s:
            row = s.get(ApiKeyRow, key_id)
            return None if row is None else _view(row)

    def revoke(self, key_id: str) -> KeyView:
        with self.store.session() as s:
            row = s.get(ApiKeyRow, key_id)
            if row is None:
                raise NotFoundError(f"no key {key_id!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                s.add(row)
            return _view(row)

    def grants(self) -> list[KeyGrant]:
        """The keys a proxy may admit (not revoked), with the tokens each has used."""
        with self.store.session() as s:
            rows = s.exec(select(ApiKeyRow).where(col(ApiKeyRow.revoked_at).is_(None))).all()
            used: dict[str, int] = defaultdict(int)
            for u in s.exec(select(UsageRow)).all():
                used[u.key_id] += u.prompt_tokens + u.completion_tokens
            return [
                KeyGrant(
                    key_id=r.key_id,
                    digest=r.secret_hash,
                    user=r.user,
                    account=r.account,
                    admin=r.admin,
                    rpm=r.rpm,
                    token_quota=r.token_quota,
                    max_concurrent=r.max_concurrent,
                    tokens_used=used[r.key_id],
                )
                for r in rows
            ]

    def add_usage(self, deltas: Mapping[str, Mapping[str, UsageCount]]) -> None:
        """Add a proxy's batched counts (key -> model -> counts) in one transaction."""
        now = utcnow()
        with self.store.session() as s:
            for key_id, models in deltas.items():
                for model, c in models.items():
                    row = s.get(UsageRow, (key_id, model)) or UsageRow(
                        key_id=key_id, model=model, updated_at=now
                    )
                    row.requests += c.requests
                    row.prompt_tokens += c.prompt_tokens
                    row.completion_tokens += c.completion_tokens
                    row.updated_at = now
                    s.add(row)

    def usage(self) -> list[UsageLine]:
        with self.store.session() as s:
            keys = {k.key_id: k for k in s.exec(select(ApiKeyRow)).all()}
            rows = s.exec(select(UsageRow).order_by(col(UsageRow.key_id), col(UsageRow.model)))
            return [
                UsageLine(
                    key_id=u.key_id,
                    user=keys[u.key_id].user if u.key_id in keys else "?",
                    account=keys[u.key_id].account if u.key_id in keys else None,
                    model=u.model,
                    requests=u.requests,
                    prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                )
                for u in rows.all()
            ]
