"""The GPU-hours of `xhpc usage` (pure): Slurm's accounting records matched to the runs xhpc
submitted, summed per (user, account, model), and joined with the keys' token counts.

A run's GPU-hours are charged to its deployment's owner, to the account Slurm charged the job to
(sacct's Account), and to the deployment's name (what clients ask for, and what the keys' usage
lines name).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta

from xhpc.access import NO_KEY, JobCharge, JobUsage, UsageLine

SUBMIT_SLACK = timedelta(seconds=60)  # the broker's clock against slurmctld's
SACCT_LAG = timedelta(minutes=10)  # a run that ended this long ago with no record has none

Group = tuple[str, str | None, str]  # (user, account, model)
Runs = Mapping[str, Sequence[JobUsage]]  # run -> its accounting records


def records_by_run(
    charges: Sequence[JobCharge], records: Iterable[JobUsage]
) -> dict[str, tuple[JobUsage, ...]]:
    """Each run's records: those of its job (a hetjob: every component) submitted no earlier
    than the run, less SUBMIT_SLACK (a requeued job's later runs are submitted anew). When
    several runs had the same job id (Slurm's ids restart when its controller is rebuilt), a
    record goes to the newest run it is not older than; a record older than every run is
    another job's and is left out. Records are sorted by (job id, submit time)."""
    runs_of: dict[str, list[JobCharge]] = defaultdict(list)
    for charge in charges:
        runs_of[charge.job_id].append(charge)
    found: dict[str, list[JobUsage]] = {charge.run: [] for charge in charges}
    for record in records:
        fits = [
            c
            for c in runs_of.get(record.leader, ())
            if c.submitted_at - SUBMIT_SLACK <= record.submitted_at
        ]
        if fits:
            found[max(fits, key=lambda c: c.submitted_at).run].append(record)
    return {
        run: tuple(sorted(got, key=lambda r: (r.job_id, r.submitted_at)))
        for run, got in found.items()
    }


def is_final(charge: JobCharge, records: Sequence[JobUsage], now: datetime) -> bool:
    """Whether a run's figures can no longer change: the last record of each of its jobs (each
    hetjob component) has ended; or, with no record at all, the store saw the run end over
    SACCT_LAG ago (a job the accounting database never had, or no longer has)."""
    if not records:
        return charge.ended_at is not None and now - charge.ended_at > SACCT_LAG
    last = {r.job_id: r for r in sorted(records, key=lambda r: (r.job_id, r.submitted_at))}
    return all(r.ended for r in last.values())


def gpu_hours_by_group(charges: Sequence[JobCharge], runs: Runs) -> dict[Group, float | None]:
    """GPU-hours per (owner, account charged, model) of the runs that have records; None for a
    group with a run whose GPUs Slurm does not track."""
    seconds: dict[Group, int | None] = {}
    for charge in charges:
        for record in runs.get(charge.run, ()):
            group = (charge.owner or "?", record.account, charge.model)
            before, more = seconds.get(group, 0), record.gpu_seconds
            seconds[group] = None if before is None or more is None else before + more
    return {g: None if s is None else round(s / 3600, 6) for g, s in seconds.items()}


def _order(group: Group) -> tuple[str, str, str]:
    user, account, model = group
    return (user, account or "", model)


def join_usage(
    lines: Sequence[UsageLine], hours: Mapping[Group, float | None] | None
) -> list[UsageLine]:
    """The keys' lines with GPU-hours (see UsageLine), ordered by user, account, model and key.
    ``hours`` None: Slurm's figures are not known, every line says so (None)."""
    by_group: dict[Group, list[UsageLine]] = defaultdict(list)
    for line in lines:
        by_group[(line.user, line.account, line.model)].append(line)
    out: list[UsageLine] = []
    for group in sorted(set(by_group) | set(hours or ()), key=_order):
        keyed = sorted(by_group.get(group, ()), key=lambda line: line.key_id)
        if hours is None:
            out.extend(line.model_copy(update={"gpu_hours": None}) for line in keyed)
            continue
        figure = hours.get(group, 0.0)
        if len(keyed) == 1:
            out.append(keyed[0].model_copy(update={"gpu_hours": figure}))
            continue
        if group in hours:
            user, account, model = group
            out.append(
                UsageLine(
                    key_id=NO_KEY,
                    user=user,
                    account=account,
                    model=model,
                    requests=0,
                    prompt_tokens=0,
                    completion_tokens=0,
                    gpu_hours=figure,
                )
            )
        out.extend(line.model_copy(update={"gpu_hours": 0.0}) for line in keyed)
    return out
