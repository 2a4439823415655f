"""The site's policy for every job xhpc submits (pure): ``[policy]`` caps on GPUs, time and
batch shards, and the partitions and QoS each account may use.

One check for every door: serve, scale, pilots and PD units (through ``admission_problems``),
batches (``batch_desk``) and weights-cache pulls (``pull_desk``) each describe their job as a
:class:`JobShape` and get back every problem at once. Slurm's own limits (a partition's MaxTime
and Allow lists, associations) are checked besides, where the broker can read them; the policy
is what the site wants on top, and holds where Slurm keeps no accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

from xhpc.errors import SlurmParseError
from xhpc.settings import XhpcConfig
from xhpc.slurm.partitions import format_minutes, parse_slurm_time

ANY_ACCOUNT = "*"  # the policy's entry for accounts it does not name


@dataclass(frozen=True)
class JobShape:
    """What a job asks Slurm for, as the policy reads it (values already allow-listed)."""

    what: str  # "the deployment", "the batch", ...: how a problem names the job
    gpus: int  # per job (a PD unit: its largest component)
    time: str  # Slurm's form; the site default when the request has none
    partition: str | None = None  # None: the site's, or Slurm's default
    qos: str | None = None
    account: str | None = None  # None: the site's (slurm.account), or the user's default
    tasks: int = 1  # a batch's array tasks


def _allowed(table: dict[str, list[str]], account: str | None) -> list[str] | None:
    """The names ``account`` may use from a per-account table; None: no restriction."""
    if not table:
        return None
    if account is not None and account in table:
        return table[account]
    return table.get(ANY_ACCOUNT)


def policy_problems(shape: JobShape, config: XhpcConfig) -> list[str]:
    """Every way ``shape`` breaks the site's ``[policy]`` (empty: within it)."""
    policy = config.policy
    problems: list[str] = []
    if policy.max_gpus is not None and shape.gpus > policy.max_gpus:
        problems.append(
            f"{shape.what} asks for {shape.gpus} GPUs per job; the site allows at most "
            f"{policy.max_gpus} ([policy] max_gpus)"
        )
    if shape.tasks > policy.max_shards:
        problems.append(
            f"{shape.what} asks for {shape.tasks} shards; the site allows at most "
            f"{policy.max_shards} ([policy] max_shards)"
        )
    if policy.max_time is not None:
        cap = parse_slurm_time(policy.max_time)
        try:
            asked = parse_slurm_time(shape.time)
        except SlurmParseError:
            asked = -1  # unreadable: the request's own validation says so
        if cap is not None and (asked is None or asked > cap):
            problems.append(
                f"{shape.what} asks for a time limit of {shape.time}; the site allows at most "
                f"{format_minutes(cap)} ([policy] max_time)"
            )
    account = shape.account or config.slurm.account
    partition = shape.partition or config.slurm.partition
    who = f"account {account!r}" if account else "jobs without an account"
    allowed = _allowed(policy.partitions, account)
    if allowed is not None and (partition is None or partition not in allowed):
        where = f"partition {partition!r}" if partition else "Slurm's default partition"
        problems.append(
            f"{who} may not use {where} ([policy] partitions: {', '.join(allowed) or 'none'})"
        )
    allowed = _allowed(policy.qos, account)
    if allowed is not None and shape.qos is not None and shape.qos not in allowed:
        problems.append(
            f"{who} may not use QoS {shape.qos!r} ([policy] qos: {', '.join(allowed) or 'none'})"
        )
    return problems
