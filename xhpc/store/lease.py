"""The leader's lease: brokers that share one database (an active one and a standby) agree on
which of them acts through a row of ``leases``.

- **One holder.** ``acquire`` takes the lease when nobody holds it, or its holder let it run
  out; the row is changed by compare-and-swap on its token (``UPDATE ... WHERE token = seen``),
  so of two brokers that saw it free only one gets it, on SQLite as on a server database.
- **A fencing token.** Each new holder gets the last token plus one. The holder renews the lease
  well before it runs out (``renew``); a renewal fails once another holds it.
- **Fenced writes.** A store whose ``fence`` is set runs ``Lease.check`` in every session's
  transaction, after its writes and before its commit: a holder whose token is no longer the
  row's (it was paused, or cut off, past its lease, and a standby took over) gets FencedError
  and its transaction is rolled back. The check is in the same transaction as the writes, so no
  takeover slips between them (SQLite: a writer whose snapshot is older than a commit cannot
  write; a server database: the check reads the row ``FOR SHARE``, which holds a takeover until
  the commit).
- **Fenced calls.** Before each ``sbatch`` and ``scancel`` the broker asks ``held`` (a read of
  the row): a former holder does not submit or cancel. The call itself cannot carry the token
  (Slurm knows nothing of it): a broker paused between its check and its call may still make
  that one call, and the new holder's sweep answers for a job it does not know.

Time is the holders' clocks (UTC): brokers on two login nodes need their clocks in step (NTP),
to well within the lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlmodel import Session, col, select, update

from xhpc.clock import aware, utcnow
from xhpc.errors import FencedError, XhpcError
from xhpc.store.store import Store
from xhpc.store.tables import LeaseRow

log = logging.getLogger(__name__)
BROKER_LEASE = "broker"


class LeaseUnreadable(XhpcError):
    """The database did not answer a lease's read or write now (busy, or unreachable): asked
    again later, never taken as the lease lost or won."""

    code = "lease_unreadable"


@contextmanager
def _answered() -> Iterator[None]:
    try:
        yield
    except SQLAlchemyError as err:
        raise LeaseUnreadable(f"the lease could not be read or written now: {err}") from err


@dataclass(frozen=True)
class LeaseState:
    """The lease as the database has it."""

    holder: str
    token: int
    expires_at: datetime
    acquired_at: datetime


class Lease:
    """One broker's side of the lease named ``name`` on ``store``, as ``holder`` (unique per
    broker process), for ``ttl_s`` at a time."""

    def __init__(
        self,
        store: Store,
        holder: str,
        ttl_s: float,
        name: str = BROKER_LEASE,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.store = store
        self.holder = holder
        self.ttl = timedelta(seconds=ttl_s)
        self.name = name
        self.clock = clock
        self.token: int | None = None  # ours while we hold it

    def state(self) -> LeaseState | None:
        with _answered(), self.store.session(fenced=False) as s:
            row = s.get(LeaseRow, self.name)
            if row is None:
                return None
            return LeaseState(row.holder, row.token, aware(row.expires_at), aware(row.acquired_at))

    def acquire(self, stale: Callable[[LeaseState], bool] | None = None) -> bool:
        with _answered():
            return self._acquire(stale)

    def _acquire(self, stale: Callable[[LeaseState], bool] | None) -> bool:
        """Take the lease if it is free (never taken, or run out, or ``stale`` says its holder
        is gone: a broker of this host whose process ended), or renew it if it is ours; True if
        we hold it now."""
        if self.token is not None and self.renew():
            return True
        now = self.clock()
        with self.store.session(fenced=False) as s:
            row = s.get(LeaseRow, self.name)
            if row is None:
                s.add(LeaseRow(name=self.name, holder=self.holder, token=1,
                               expires_at=now + self.ttl, acquired_at=now))  # fmt: skip
                try:
                    s.flush()
                except IntegrityError:  # another broker took it first
                    s.rollback()
                    return False
                self.token = 1
                return True
            state = LeaseState(row.holder, row.token, aware(row.expires_at), aware(row.acquired_at))
            if state.expires_at > now and (stale is None or not stale(state)):
                return False
            seen = row.token
            try:
                taken = s.execute(
                    update(LeaseRow)
                    .where(col(LeaseRow.name) == self.name, col(LeaseRow.token) == seen)
                    .values(
                        holder=self.holder,
                        token=seen + 1,
                        expires_at=now + self.ttl,
                        acquired_at=now,
                    )
                )
            except OperationalError:  # SQLite: another took it since we read the row
                s.rollback()
                return False
            if taken.rowcount != 1:  # type: ignore[attr-defined]
                return False
        self.token = seen + 1
        return True

    def renew(self) -> bool:
        """Push the lease's end ``ttl_s`` from now; False (and no token) if it is not ours;
        LeaseUnreadable if the database does not answer now."""
        with _answered():
            return self._renew()

    def _renew(self) -> bool:
        if self.token is None:
            return False
        with self.store.session(fenced=False) as s:
            kept = s.execute(
                update(LeaseRow)
                .where(
                    col(LeaseRow.name) == self.name,
                    col(LeaseRow.holder) == self.holder,
                    col(LeaseRow.token) == self.token,
                )
                .values(expires_at=self.clock() + self.ttl)
            )
            if kept.rowcount == 1:  # type: ignore[attr-defined]
                return True
        log.error("lease %s lost: another broker holds it (our token was %d)", self.name,
                  self.token)  # fmt: skip
        self.token = None
        return False

    def release(self) -> None:
        """Let the lease run out now (a clean stop: a standby takes over at once)."""
        if self.token is None:
            return
        with self.store.session(fenced=False) as s:
            s.execute(
                update(LeaseRow)
                .where(
                    col(LeaseRow.name) == self.name,
                    col(LeaseRow.holder) == self.holder,
                    col(LeaseRow.token) == self.token,
                )
                .values(expires_at=self.clock())
            )
        self.token = None

    def held(self) -> bool:
        """Whether the database still says the lease is ours (a read)."""
        state = self.state()
        return state is not None and (state.holder, state.token) == (self.holder, self.token)

    def assert_held(self) -> None:
        """Before a Slurm call that acts (sbatch, scancel): FencedError unless it is ours."""
        if not self.held():
            raise FencedError(
                f"this broker's lease {self.name!r} is no longer its own: it submits and cancels "
                "no job",
                hint="another broker took over; this one stops",
            )

    def check(self, session: Session) -> None:
        """The store's fence: raise FencedError inside ``session``'s transaction unless the
        lease is still ours (see the module's docstring)."""
        query = select(LeaseRow.holder, LeaseRow.token).where(col(LeaseRow.name) == self.name)
        if session.get_bind().dialect.name != "sqlite":
            query = query.with_for_update(read=True)
        row = session.exec(query).first()
        if row is None or (row[0], row[1]) != (self.holder, self.token):
            raise FencedError(
                f"this broker's lease {self.name!r} (token {self.token}) is no longer its own: "
                f"{'nobody' if row is None else f'{row[0]} (token {row[1]})'} holds it",
                hint="another broker took over; this one stops",
            )


def expire_restored(store: Store) -> None:
    """Every lease of a state just restored from a backup runs out now, its token kept: no
    broker runs on it (a restore checks), so the holders its backup names are gone, on whatever
    host they ran; the next broker takes the lease at once, with the next token."""
    with store.session(fenced=False) as s:
        s.execute(update(LeaseRow).values(expires_at=utcnow()))
