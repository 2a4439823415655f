"""Every row of a state, from one database to another of the same schema (either backend).

``xhpc state backup`` of a PostgreSQL state copies it into the backup's SQLite file, and
``restore`` into a PostgreSQL state copies the backup's rows into it: one archive format for
both backends, and a state moves between them through it. The source is read in one
transaction (on PostgreSQL ``REPEATABLE READ``: one snapshot, consistent while a broker writes);
the destination is written in one transaction, parents before children (foreign keys), and a
server database's id sequences are set past the copied ids.
"""

from __future__ import annotations

from sqlalchemy import Integer, func, insert, select, text
from sqlalchemy.engine import Connection, Engine
from sqlmodel import SQLModel

from xhpc.errors import ValidationError

BATCH = 500


def _tables() -> list:  # type: ignore[type-arg]
    from xhpc.store import tables  # noqa: F401  (registers every table in the metadata)

    return list(SQLModel.metadata.sorted_tables)


def schema_of(engine: Engine) -> int:
    """The schema version a database is at (0: none yet), read without writing."""
    with engine.connect() as conn:
        if not engine.dialect.has_table(conn, "schema_version"):
            return 0
        return int(conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0)


def rows_in(engine: Engine) -> int:
    """How many rows the state's tables hold (the tables that exist)."""
    total = 0
    with engine.connect() as conn:
        for table in _tables():
            if engine.dialect.has_table(conn, table.name):
                total += int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)
    return total


def copy_state(source: Engine, dest: Engine) -> int:
    """Copy every row of ``source`` into ``dest`` (same schema version, no rows); the rows."""
    if schema_of(source) != schema_of(dest):
        raise ValidationError(
            f"cannot copy a state of schema {schema_of(source)} into one of {schema_of(dest)}"
        )
    read = source.connect()
    if source.dialect.name == "postgresql":
        read = read.execution_options(isolation_level="REPEATABLE READ")
    copied = 0
    try:
        with read.begin(), dest.begin() as write:
            for table in _tables():
                result = read.execution_options(stream_results=True).execute(select(table))
                while batch := [dict(row) for row in result.mappings().fetchmany(BATCH)]:
                    write.execute(insert(table), batch)
                    copied += len(batch)
            if dest.dialect.name == "postgresql":
                _advance_sequences(write)
    finally:
        read.close()
    return copied


def _advance_sequences(conn: Connection) -> None:
    """Set each integer id's sequence past the largest id copied (the next insert's is new)."""
    for table in _tables():
        for column in table.primary_key.columns:
            if not isinstance(column.type, Integer) or column.autoincrement is False:
                continue
            sequence = conn.execute(
                text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table.name, "c": column.name}
            ).scalar()
            if sequence is None:
                continue
            top = conn.execute(select(func.max(column))).scalar()
            if top is not None:
                conn.execute(text("SELECT setval(:s, :v)"), {"s": sequence, "v": int(top)})
