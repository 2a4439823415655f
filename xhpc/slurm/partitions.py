"""Parsers for `scontrol show partition` / `scontrol show config` / `scontrol show topology`, a
user's Slurm associations (`sacctmgr`) and Slurm time strings (pure).

Fed with output captured from the real dev cluster (tests/data/slurm/scontrol-show-*.txt).
"""

from __future__ import annotations

import math
import re

from xhpc.errors import SlurmParseError
from xhpc.models import PartitionInfo

_UNLIMITED = {"UNLIMITED", "INFINITE"}
_UNSET = {"NONE", "(NULL)", "N/A", ""}
_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)=(.*)$")
# Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (seconds round up to the next minute).
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def parse_slurm_time(text: str) -> int | None:
    """A Slurm time limit -> whole minutes (seconds round up, as Slurm does); None: unlimited.

    ``"30"`` (minutes), ``"30:15"`` (minutes:seconds), ``"01:00:00"``, ``"2-12"`` (days-hours),
    ``"2-12:30"``, ``"1-00:00:00"``, ``"UNLIMITED"`` / ``"INFINITE"``.
    """
    value = text.strip()
    if value.upper() in _UNLIMITED:
        return None
    m = _TIME.fullmatch(value)
    if not m:
        raise SlurmParseError(f"cannot read Slurm time {text!r} (use [D-]HH:MM:SS)")
    days, d_hours, d_mins, d_secs, mins, m_secs, h_secs = m.groups()
    if days is not None:
        seconds = int(days) * 86400 + int(d_hours) * 3600 + int(d_mins or 0) * 60 + int(d_secs or 0)
    elif h_secs is not None:  # H:M:S
        seconds = int(mins) * 3600 + int(m_secs) * 60 + int(h_secs)
    else:  # M or M:S
        seconds = int(mins) * 60 + int(m_secs or 0)
    return math.ceil(seconds / 60)


def format_minutes(minutes: int | None) -> str:
    """Minutes -> Slurm's ``[D-]HH:MM:SS`` (``UNLIMITED`` for None)."""
    if minutes is None:
        return "UNLIMITED"
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    clock = f"{hours:02d}:{mins:02d}:00"
    return f"{days}-{clock}" if days else clock


def _fields(line: str) -> dict[str, str]:
    """``Key=Value`` tokens of one ``-o`` line; a token without ``=`` continues the last value
    (a value with spaces). Values may hold ``=`` themselves (``TRES=cpu=24,mem=24000M``)."""
    out: dict[str, str] = {}
    last: str | None = None
    for token in line.split():
        m = _KEY.match(token)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None:
            out[last] += " " + token
    return out


def _time_field(fields: dict[str, str], key: str, name: str) -> int | None:
    raw = fields.get(key, "UNLIMITED")
    if raw.upper() in _UNSET:
        return None
    try:
        return parse_slurm_time(raw)
    except SlurmParseError as err:
        raise SlurmParseError(f"partition {name}: {key}={raw!r} is not a Slurm time") from err


def _names(raw: str | None) -> tuple[str, ...] | None:
    """``ALL`` (or absent) -> None (no restriction); ``a,b`` -> ("a", "b")."""
    if raw is None or raw.upper() == "ALL":
        return None
    return tuple(x for x in raw.split(",") if x and x.upper() not in _UNSET)


def parse_partitions(text: str) -> list[PartitionInfo]:
    """`scontrol --all --oneliner show partition` -> partitions, in Slurm's order.

    Lines that are not partitions ("No partitions in the system") are skipped.
    """
    parts: list[PartitionInfo] = []
    for line in text.splitlines():
        if not line.startswith("PartitionName="):
            continue
        f = _fields(line)
        name = f["PartitionName"]
        nodes = f.get("Nodes")
        parts.append(
            PartitionInfo(
                name=name,
                state=f.get("State", "UP").upper(),
                default=f.get("Default", "NO").upper() == "YES",
                nodes=None if nodes is None or nodes.upper() in _UNSET else nodes,
                max_time_min=_time_field(f, "MaxTime", name),
                default_time_min=_time_field(f, "DefaultTime", name),
                allow_accounts=_names(f.get("AllowAccounts")),
                deny_accounts=_names(f.get("DenyAccounts")) or (),
                allow_qos=_names(f.get("AllowQos")),
                deny_qos=_names(f.get("DenyQos")) or (),
            )
        )
    return parts


def parse_scontrol_config(text: str) -> dict[str, str]:
    """`scontrol show config` -> {key: value} for its ``Key = Value`` lines."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def parse_topology(text: str) -> dict[str, str]:
    """`scontrol show topology` -> each leaf switch (``Level=0``) and its nodes, a Slurm
    hostlist as printed (``n[1-2]``); {} when the cluster has no tree topology (Slurm then
    prints no ``SwitchName`` line)."""
    leaves: dict[str, str] = {}
    for line in text.splitlines():
        fields = {m[1]: m[2] for m in map(_KEY.match, line.split()) if m is not None}
        name, nodes = fields.get("SwitchName"), fields.get("Nodes")
        if name and nodes and fields.get("Level", "0") == "0":
            leaves[name] = nodes
    return leaves


def accounting_enabled(storage_type: str | None) -> bool:
    """Whether the site keeps accounting (slurmdbd or another storage plugin)."""
    if storage_type is None:
        return False
    return storage_type.strip().lower() not in {"", "(null)", "accounting_storage/none", "none"}


def parse_user_accounts(text: str, cluster: str | None) -> list[str]:
    """`sacctmgr --noheader --parsable2 show associations where user=U format=cluster,account`
    -> the accounts of ``cluster``'s associations (every cluster's when ``cluster`` is None),
    each once, in sacctmgr's order. An empty output: the user has no association."""
    accounts: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        where, sep, account = line.strip().partition("|")
        if not sep or "|" in account:
            raise SlurmParseError(f"sacctmgr association line is not CLUSTER|ACCOUNT: {line!r}")
        if account and (cluster is None or where == cluster) and account not in accounts:
            accounts.append(account)
    return accounts


def time_limit_problems(raw: str, what: str, partition: PartitionInfo | None) -> list[str]:
    """A job's time limit ``raw`` (named ``what`` in the message) fits the partition's MaxTime
    (Slurm would otherwise leave the job PENDING with reason PartitionTimeLimit)."""
    try:
        minutes = parse_slurm_time(raw)
    except SlurmParseError:
        return [f"{what} {raw!r} is not a Slurm time limit ([D-]HH:MM:SS)"]
    if partition is None or partition.max_time_min is None:
        return []
    if minutes is None or minutes > partition.max_time_min:
        limit = format_minutes(partition.max_time_min)
        return [f"{what} {raw} is longer than MaxTime {limit} of partition {partition.name!r}"]
    return []


def _listed(
    what: str, key: str, value: str, allow: tuple[str, ...] | None, deny: tuple[str, ...], part: str
) -> list[str]:
    if allow is not None and value not in allow:
        return [f"{what} {value!r} may not use partition {part!r} (Allow{key}={','.join(allow)})"]
    if value in deny:
        return [f"{what} {value!r} is denied partition {part!r} (Deny{key}={','.join(deny)})"]
    return []


def access_problems(
    partition: PartitionInfo | None, account: str | None, qos: str | None
) -> list[str]:
    """Account and QOS against the partition's AllowAccounts/DenyAccounts and AllowQos/DenyQos
    (None: the user's default, which only Slurm knows)."""
    if partition is None:
        return []
    p = partition
    problems: list[str] = []
    if account is not None:
        problems += _listed(
            "account", "Accounts", account, p.allow_accounts, p.deny_accounts, p.name
        )
    if qos is not None:
        problems += _listed("QOS", "Qos", qos, p.allow_qos, p.deny_qos, p.name)
    return problems
