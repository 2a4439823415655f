"""Readers of Slurm's narrow text listings: ``sinfo -O`` (nodes) and ``squeue -O`` (jobs) (pure).

What the broker reads of ``sinfo --json`` / ``squeue --json`` (13 MB and 81 MB at 10k nodes with
21k jobs), asked for as one line per record of only those fields, ``SEP`` after each field
(docs/decisions/0008-snapshot-ingest.md). A line is read only if it cannot be misread:

- ``SEP`` (ASCII unit separator) never occurs in the values Slurm controls; the free text
  (a node's reason; a job's reason, name and comment) sits between fixed fields and a last field
  that repeats the first (node name, job id). A line must have exactly the expected fields and
  end with its own first field, and no record may appear twice: so a value holding ``SEP`` or a
  line break (Slurm lets users put any byte but NUL in a job name or comment) makes the text
  unreadable (:class:`SlurmParseError`) instead of splitting or forging records. The client then
  asks for the JSON (``xhpc.slurm.client``).
- Each value is read as the JSON parsers read the same field (``xhpc.slurm.parse``).

:class:`SinfoReader` / :class:`SqueueReader` keep the records of the previous read: a node or job
whose line is unchanged is the same (immutable) object again, so a poll of a large cluster
builds only what changed. ``squeue -O`` cannot print a job's GPU indexes: those come from
``scontrol -d -o show job`` (:mod:`xhpc.slurm.details`) for the jobs holding an allocation, once
per run of a job (kept by the reader, keyed by job id, start time and nodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from xhpc.errors import SlurmParseError
from xhpc.models import JobInfo, NodeInfo
from xhpc.slurm.parse import Gres, parse_gres

SEP = "\x1f"
# sinfo --Node: one line per node and partition; the node name again last
SINFO_FIELDS = (
    "NodeList",
    "NodeAddr",
    "StateComplete",
    "PartitionName",
    "Gres",
    "GresUsed",
    "CPUsState",
    "Reason",
    "NodeList",
)
# squeue: the job id again last; the free text (reason, name, comment) just before it
SQUEUE_FIELDS = (
    "JobID",
    "State",
    "HetJobID",
    "HetJobOffset",
    "ArrayJobID",
    "ArrayTaskID",
    "UserName",
    "Partition",
    "NodeList",
    "BatchHost",
    "BatchFlag",
    "TimeLimit",
    "StartTime",
    "RestartCnt",
    "Reason",
    "Name",
    "Comment",
    "JobID",
)
# squeue prints StartTime as SLURM_TIME_FORMAT says: seconds since the epoch
SQUEUE_ENV = {"SLURM_TIME_FORMAT": "%s"}
# States in which a job holds an allocation: the ones whose GPU indexes Slurm reports
ALLOCATED_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
    }
)
_NO_TEXT = ("", "(null)", "N/A", "n/a")


def format_option(fields: Sequence[str]) -> str:
    """``-O`` value: every field unpadded (width 0), ``SEP`` after all but the last."""
    return ",".join([f"{f}:{SEP}" for f in fields[:-1]] + [f"{fields[-1]}:"])


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _bad(what: str, line: str, why: str) -> SlurmParseError:
    return SlurmParseError(f"{what}: {why}: {line[:200]!r}", stdout=line[:2000])


# -- nodes ------------------------------------------------------------------------------------
NodeKey = tuple[str, tuple[str, ...]]  # the node's first line, its partitions


class SinfoReader:
    """Reads successive ``sinfo -O`` listings (:data:`SINFO_FIELDS`); see the module doc."""

    def __init__(self) -> None:
        self._known: dict[NodeKey, NodeInfo] = {}

    def read(self, text: str) -> list[NodeInfo]:
        """One :class:`NodeInfo` per node, sorted by name (its partitions in Slurm's order)."""
        what = "sinfo -O"
        width = len(SINFO_FIELDS)
        first: dict[str, str] = {}
        parts: dict[str, list[str]] = {}
        for line in _lines(text):
            fields = line.split(SEP)
            if len(fields) < width:
                raise _bad(what, line, f"{len(fields)} fields, not {width}")
            name, partition = fields[0], fields[3]
            if not name or fields[-1] != name or not partition:
                raise _bad(what, line, "not a node line")
            held = parts.get(name)
            if held is None:
                first[name] = line
                parts[name] = [partition]
            elif partition in held:
                raise _bad(what, line, f"node {name} twice in partition {partition}")
            else:
                held.append(partition)
        known = self._known
        seen_gres: dict[str, Gres] = {}  # (GRES strings: few distinct ones)
        now: dict[NodeKey, NodeInfo] = {}
        nodes: list[NodeInfo] = []
        for name in sorted(first):
            key = (first[name], tuple(parts[name]))
            node = known.get(key)
            if node is None:
                node = _node(name, key, seen_gres, what)
            now[key] = node
            nodes.append(node)
        self._known = now
        return nodes


def _node(name: str, key: NodeKey, seen_gres: dict[str, Gres], what: str) -> NodeInfo:
    line, partitions = key
    fields = line.split(SEP)
    _, address, state_text, _, gres, gres_used, cpus_state = fields[:7]
    reason = SEP.join(fields[7:-1])  # (SEP inside it is read as part of it)
    state, *flags = state_text.upper().split("+")
    total, gtype, _ = seen_gres.get(gres) or seen_gres.setdefault(gres, parse_gres(gres))
    used, _, used_idx = seen_gres.get(gres_used) or seen_gres.setdefault(
        gres_used, parse_gres(gres_used)
    )
    cpus = cpus_state.rsplit("/", 1)[-1]
    if not cpus.isdigit():
        raise _bad(what, line, f"CPUs {cpus_state!r}")
    return NodeInfo(
        name=name,
        address=address if address not in _NO_TEXT else name,
        state=state or "UNKNOWN",
        state_flags=tuple(flags),
        partitions=partitions,
        gpus_total=total,
        gpus_used=used,
        gpu_type=gtype,
        gpus_used_idx=used_idx,
        cpus=int(cpus),
        reason=None if reason in ("", "none") else reason,
    )


def parse_sinfo_text(text: str) -> list[NodeInfo]:
    """``sinfo -O`` listing (:data:`SINFO_FIELDS`) -> one :class:`NodeInfo` per node, by name."""
    return SinfoReader().read(text)


# -- jobs ---------------------------------------------------------------------------------------
DetailKey = tuple[int, int | None, str | None]  # job id, start time, nodes: one run of a job
Details = Mapping[int, tuple[str, ...]]  # job id -> gres detail per node (xhpc.slurm.details)


class SqueueReader:
    """Reads successive ``squeue -O`` listings (:data:`SQUEUE_FIELDS`); see the module doc."""

    def __init__(self) -> None:
        self._known: dict[str, JobInfo] = {}  # line -> job (with its GPU detail, if it needs one)
        self._details: dict[DetailKey, tuple[str, ...]] = {}

    def read(self, text: str, details: Details | None = None) -> tuple[list[JobInfo], list[int]]:
        """The jobs in Slurm's order, and the ids of those holding an allocation whose GPU detail
        is not known yet (in neither an earlier read nor ``details``): they are listed without
        one, and read again when ``details`` has theirs."""
        what = "squeue -O"
        width = len(SQUEUE_FIELDS)
        known, details_known = self._known, self._details
        now: dict[str, JobInfo] = {}
        now_details: dict[DetailKey, tuple[str, ...]] = {}
        started: dict[str, datetime] = {}
        jobs: list[JobInfo] = []
        missing: list[int] = []
        ids: set[str] = set()
        for line in _lines(text):
            fields = line.split(SEP)
            if len(fields) != width or fields[0] != fields[-1] or not fields[0].isdigit():
                raise _bad(what, line, f"not a job line of {width} fields")
            if fields[0] in ids:
                raise _bad(what, line, f"job {fields[0]} twice")
            ids.add(fields[0])
            job = known.get(line)
            if job is None:
                job = _job(fields, started, line, what)
                if job.state in ALLOCATED_STATES:
                    key = (job.raw_job_id, _epoch(fields[12]), job.nodes)
                    detail = details_known.get(key)
                    if detail is None and details is not None:
                        detail = details.get(job.raw_job_id)
                    if detail is None:
                        missing.append(job.raw_job_id)
                        jobs.append(job)
                        continue
                    now_details[key] = detail
                    job = _with_detail(job, detail)
            elif job.state in ALLOCATED_STATES:
                key = (job.raw_job_id, _epoch(fields[12]), job.nodes)
                now_details[key] = job.gres_detail
            now[line] = job
            jobs.append(job)
        self._known, self._details = now, now_details
        return jobs, missing


def _with_detail(job: JobInfo, detail: tuple[str, ...]) -> JobInfo:
    idx: tuple[int, ...] = ()
    for d in detail:
        idx = (*idx, *parse_gres(d)[2])
    return JobInfo(
        job_id=job.job_id,
        raw_job_id=job.raw_job_id,
        name=job.name,
        state=job.state,
        reason=job.reason,
        user=job.user,
        partition=job.partition,
        nodes=job.nodes,
        batch_host=job.batch_host,
        comment=job.comment,
        gpus_idx=idx,
        gres_detail=detail,
        het_job_id=job.het_job_id,
        het_job_offset=job.het_job_offset,
        array_job_id=job.array_job_id,
        array_task_id=job.array_task_id,
        time_limit_min=job.time_limit_min,
        start_time=job.start_time,
        restart_count=job.restart_count,
    )


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _epoch(text: str) -> int | None:
    value = _int(text)
    return value or None


def _text(text: str) -> str | None:
    return None if text in _NO_TEXT else text


def _minutes(text: str) -> int | None:
    """TimeLimit ``[days-][hours:]minutes:seconds`` -> whole minutes (UNLIMITED, NOT_SET and
    INVALID, i.e. a year or more: None)."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if (
        not 2 <= len(parts) <= 3
        or not all(p.isdigit() for p in parts)
        or (days and not days.isdigit())
    ):
        return None
    hours = int(parts[0]) if len(parts) == 3 else 0
    return (int(days or 0) * 24 + hours) * 60 + int(parts[-2])


def _job(fields: list[str], started: dict[str, datetime], line: str, what: str) -> JobInfo:
    (jid_text, state, het_text, het_off_text, arr_text, task_text, user, partition, nodes) = fields[
        :9
    ]
    batch_host, batch_flag, limit, start_text, restarts, reason, name, comment = fields[9:17]
    jid = int(jid_text)
    if not state or not state.replace("_", "").isalpha():
        raise _bad(what, line, f"job state {state!r}")
    het = _int(het_text)
    het_off = _int(het_off_text) if het else None
    arr = _int(arr_text)
    task = _int(task_text)
    if arr == jid and task is None and task_text in _NO_TEXT:
        arr = None  # (squeue prints a plain job's own id as its array job id)
    if het and het_off is not None:
        job_id = f"{het}+{het_off}"
    elif arr and task is not None:
        job_id = f"{arr}_{task}"
    elif arr and task_text not in _NO_TEXT:
        job_id = f"{arr}_[{task_text}]"
    else:
        job_id = jid_text
    start = _epoch(start_text)
    start_time = None
    if start:
        start_time = started.get(start_text)
        if start_time is None:
            start_time = started[start_text] = datetime.fromtimestamp(start, UTC)
    return JobInfo(
        job_id=job_id,
        raw_job_id=jid,
        name=name if name != "(null)" else "",
        state=state.upper(),
        reason=None if reason in ("", "None", "(null)") else reason,
        user=_text(user),
        partition=_text(partition),
        nodes=_text(nodes),
        batch_host=_text(batch_host) if batch_flag == "1" else None,  # (else: the submit host)
        comment=_text(comment),
        het_job_id=het or None,
        het_job_offset=het_off,
        array_job_id=arr or None,
        array_task_id=task if arr else None,
        time_limit_min=_minutes(limit),
        start_time=start_time,
        restart_count=_int(restarts) or 0,
    )


def parse_squeue_text(text: str, details: Details | None = None) -> list[JobInfo]:
    """``squeue -O`` listing (:data:`SQUEUE_FIELDS`) and the GPU details of its jobs
    (:func:`xhpc.slurm.details.parse_job_details`) -> one :class:`JobInfo` per record."""
    return SqueueReader().read(text, details)[0]
