"""Keeping a deployment's desired state (pure): replacements, walltime handover, crash loops.

The reconcile loop calls :func:`decide` once per deployment with its members (replicas, as
frozen domain values) and gets the actions that move it towards what was asked: launch
replacements (after a backoff, avoiding nodes that just failed), submit a successor before a
job's time limit and retire the predecessor once the successor serves, give up on LOST replicas,
fail a deployment that crash-loops, end one whose `--for` has passed. See docs/lifecycle.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from xhpc.models import ReplicaState, RestartPolicy
from xhpc.settings import LifecycleConfig

S = ReplicaState
COUNTED = frozenset({S.CREATING, S.QUEUED, S.STARTING, S.READY})
LIVE = COUNTED | {S.LOST}
# A replica that served less than this before failing failed to start, for the crash-loop cap.
SHORT_LIFE = timedelta(seconds=60)
MEASURED_STARTS = 5  # recent starts whose queue wait + engine start size the handover lead


@dataclass(frozen=True)
class Member:
    """One replica of a deployment, as continuity sees it."""

    replica_id: str
    state: ReplicaState
    created_at: datetime
    updated_at: datetime
    node: str | None = None
    ready_at: datetime | None = None
    ends_at: datetime | None = None  # its job's end (RUNNING jobs with a time limit)
    successor_of: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Desire:
    """What the owner asked of a deployment."""

    name: str
    wanted: int
    restart: RestartPolicy
    until_at: datetime | None = None


@dataclass(frozen=True)
class Decision:
    launch: int = 0  # replacements to submit now
    avoid: tuple[str, ...] = ()  # nodes the replacements should not use (cooldown)
    successors: tuple[str, ...] = ()  # predecessors that get a successor now (handover)
    retire: tuple[tuple[str, str], ...] = ()  # (replica, successor): drain the predecessor
    expire: tuple[str, ...] = ()  # LOST past the grace: give up on them
    notes: tuple[tuple[str, str], ...] = ()  # (replica, why its handover has not happened)
    fail: str | None = None  # the deployment crash-loops: FAILED, with this reason
    end: str | None = None  # the deployment's time is up: stop it
    wait_s: float | None = None  # a replacement is due after this backoff

    @property
    def empty(self) -> bool:
        return not (
            self.launch
            or self.successors
            or self.retire
            or self.expire
            or self.notes
            or self.fail
            or self.end
        )


def _failures(members: Sequence[Member], now: datetime, window: timedelta) -> list[Member]:
    """Replicas that failed (not stopped) inside the window, oldest first."""
    out = [m for m in members if m.state is S.FAILED and now - m.updated_at <= window]
    return sorted(out, key=lambda m: m.updated_at)


def _failed_start(m: Member) -> bool:
    return m.ready_at is None or m.updated_at - m.ready_at < SHORT_LIFE


def handover_lead(members: Sequence[Member], cfg: LifecycleConfig) -> timedelta:
    """How long before a job's end its successor is submitted: the site's floor, or this
    deployment's measured queue wait + engine start (the slowest of its recent starts) times
    the margin, whichever is longer."""
    measured = measured_start_s(members) or 0.0
    return timedelta(seconds=max(cfg.handover_floor_s, measured * cfg.handover_margin))


def measured_start_s(members: Sequence[Member]) -> float | None:
    """The slowest of the deployment's recent starts (queue wait + engine start: submission to
    READY), in seconds; None before any replica was READY."""
    starts = sorted(
        (m for m in members if m.ready_at is not None), key=lambda m: m.created_at, reverse=True
    )[:MEASURED_STARTS]
    return max(
        ((m.ready_at - m.created_at).total_seconds() for m in starts if m.ready_at), default=None
    )


def _handover(
    members: Sequence[Member], desire: Desire, cfg: LifecycleConfig, now: datetime
) -> tuple[list[str], list[tuple[str, str]], list[tuple[str, str]]]:
    successors: list[str] = []
    retire: list[tuple[str, str]] = []
    notes: list[tuple[str, str]] = []
    by_pred = {m.successor_of: m for m in members if m.successor_of and m.state in LIVE}
    lead = handover_lead(members, cfg)
    for m in members:
        if m.state is not S.READY or m.ends_at is None:
            continue
        succ = by_pred.get(m.replica_id)
        if succ is None:
            if desire.restart is not RestartPolicy.NEVER and now >= m.ends_at - lead:
                successors.append(m.replica_id)
            continue
        if succ.state is S.READY:
            retire.append((m.replica_id, succ.replica_id))
            continue
        why = succ.reason or succ.state.value
        ends = m.ends_at.strftime("%H:%M:%S")
        note = f"handover: successor {succ.replica_id} is {succ.state.value} ({why}); ends {ends}"
        if m.reason != note:
            notes.append((m.replica_id, note))
    return successors, retire, notes


def decide(
    desire: Desire,
    members: Sequence[Member],
    cfg: LifecycleConfig,
    now: datetime,
    *,
    ever_ready: bool,
) -> Decision:
    """The actions that move one deployment towards ``desire`` (never more than one step of
    each kind per call: the loop calls again)."""
    if desire.until_at is not None and now >= desire.until_at:
        return Decision(end=f"its --for time is up ({desire.until_at.isoformat()})")
    lost_grace = timedelta(seconds=cfg.lost_grace_s)
    expire = tuple(
        m.replica_id for m in members if m.state is S.LOST and now - m.updated_at > lost_grace
    )
    successors, retire, notes = _handover(members, desire, cfg, now)
    live = [m for m in members if m.state in LIVE and m.replica_id not in expire]
    # A successor stands in for its live predecessor: the pair counts once.
    live_ids = {m.replica_id for m in live}
    counted = [m for m in live if not (m.successor_of and m.successor_of in live_ids)]
    missing = desire.wanted - len(counted)
    window = timedelta(seconds=cfg.crash_loop_window_s)
    failures = _failures(members, now, window)
    starts = [m for m in failures if _failed_start(m)]
    if missing > 0 and len(starts) >= cfg.crash_loop_starts:
        last = starts[-1]
        fail = (
            f"crash loop: {len(starts)} failed starts in {cfg.crash_loop_window_s:.0f}s; "
            f"last: {last.replica_id}: {last.reason or 'failed'}"
        )
        return Decision(fail=fail)
    wait_s = _backoff(failures, cfg, now)
    launch = 0
    if missing > 0 and ever_ready and restarts(desire.restart, members) and wait_s is None:
        launch = missing
    if wait_s is not None or len(starts) >= cfg.crash_loop_starts:
        # Successors wait out the same backoff; after a crash loop's worth of failed starts
        # the predecessor serves to its end instead (then the deployment fails, above).
        successors = []
    cooldown = timedelta(seconds=cfg.node_cooldown_s)
    avoid = tuple(
        sorted(
            {
                m.node
                for m in members
                if m.node and m.state is S.FAILED and now - m.updated_at <= cooldown
            }
        )
    )
    return Decision(
        launch=launch,
        avoid=avoid,
        successors=tuple(successors),
        retire=tuple(retire),
        expire=expire,
        notes=tuple(notes),
        wait_s=wait_s,
    )


def _backoff(failures: Sequence[Member], cfg: LifecycleConfig, now: datetime) -> float | None:
    """Seconds until the next launch may go (None: now): doubling with each recent failure."""
    if not failures:
        return None
    backoff = min(cfg.backoff_s * 2 ** (len(failures) - 1), cfg.backoff_max_s)
    due = failures[-1].updated_at + timedelta(seconds=backoff)
    return (due - now).total_seconds() if now < due else None


def restarts(policy: RestartPolicy, members: Sequence[Member]) -> bool:
    """always: every end is replaced; on-failure: only when the latest end was a failure."""
    if policy is RestartPolicy.ALWAYS:
        return True
    if policy is RestartPolicy.NEVER:
        return False
    ended = [m for m in members if m.state in (S.FAILED, S.STOPPED)]
    return bool(ended) and max(ended, key=lambda m: m.updated_at).state is S.FAILED
