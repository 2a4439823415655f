"""Secrets the brokers of one state share, kept in its database (``secrets``): the first broker
that asks for one makes it; every broker after it reads the same value."""

from __future__ import annotations

import secrets

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from xhpc.errors import XhpcError
from xhpc.store.store import Store
from xhpc.store.tables import SecretRow


def shared_secret(store: Store, name: str) -> str:
    """The secret ``name`` of this state, made (32 random bytes, hex) if it has none yet; of two
    brokers that make it at once, the first one's is kept and both return it. XhpcError when
    the database does not answer now."""
    try:
        return _shared_secret(store, name)
    except SQLAlchemyError as err:
        raise XhpcError(f"the state's secret {name!r} could not be read now: {err}") from err


def _shared_secret(store: Store, name: str) -> str:
    with store.session(fenced=False) as s:
        row = s.get(SecretRow, name)
        if row is not None:
            return row.value
        s.add(SecretRow(name=name, value=secrets.token_hex(32)))
        try:
            s.flush()
        except IntegrityError:  # another broker made it first
            s.rollback()
    with store.session(fenced=False) as s:
        row = s.get(SecretRow, name)
        assert row is not None
        return row.value
