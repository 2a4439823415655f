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

:class:`SinfoReader` / :class:`SqueueReader` keep the previous read's lines and records: a node or
job whose line is unchanged is the same (immutable) object again, so a poll of a large cluster
builds only what changed, and an unchanged line is not split or checked again. A line read
before was checked then (its fields, its own id last), and the checks across lines still hold:
a listing whose lines are the previous one's but for some that name the same record at the same
place (compared in one pass in C) cannot name a record twice, since the previous one did not;
in any other listing a line not in the previous one must name a record no other line names.
``squeue -O`` cannot print a job's GPU indexes: those come from ``scontrol -d -o show job``
(:mod:`xhpc.slurm.details`) for the jobs holding an allocation, once per run of a job (a job
whose line changed keeps the detail of its previous line if that had the same start time and
nodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from itertools import compress, filterfalse
from operator import ne

from xhpc.errors import SlurmParseError
from xhpc.models import HOLDING_STATES, JobInfo, NodeInfo
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
_NO_TEXT = ("", "(null)", "N/A", "n/a")
WHAT_SINFO, WHAT_SQUEUE = "sinfo -O", "squeue -O"


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
LineKey = tuple[str, str]  # a sinfo line's node and partition
NodeKey = tuple[str, tuple[str, ...]]  # the node's first line, its partitions


class SinfoReader:
    """Reads successive ``sinfo -O`` listings (:data:`SINFO_FIELDS`); see the module doc.

    It keeps the previous listing's lines and, per line, the node and partition it was read as.
    A line equal to the previous listing's line at the same place is not read again: if every
    changed line names the node and partition of the line it replaces, the listing has the
    previous one's shape (so no node-partition twice) and only those nodes are built again.
    Otherwise each line is looked up among the previous ones (a dict lookup) or read.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._keys: list[LineKey] = []  # per line: its node and partition
        self._first: dict[str, int] = {}  # node -> its first line
        self._parts: dict[str, tuple[str, ...]] = {}  # node -> its partitions, in Slurm's order
        self._nodes: list[NodeInfo] = []  # by name
        self._at: dict[str, int] = {}  # node -> its place in _nodes

    def read(self, text: str) -> list[NodeInfo]:
        """One :class:`NodeInfo` per node, sorted by name (its partitions in Slurm's order)."""
        lines = _lines(text)
        nodes = self._same_shape(lines)
        if nodes is None:
            nodes = self._read_all(lines)
        return list(nodes)

    def _same_shape(self, lines: list[str]) -> list[NodeInfo] | None:
        """The nodes, if ``lines`` differ from the previous listing's only in lines that name
        the node and partition of the line they replace; else None."""
        before, keys = self._lines, self._keys
        if not before or len(lines) != len(before):
            return None
        changed = list(compress(range(len(lines)), map(ne, lines, before)))
        if any(_line_key(lines[i]) != keys[i] for i in changed):
            return None
        nodes = self._nodes
        if changed:
            nodes = list(nodes)
            seen_gres: dict[str, Gres] = {}
            for name in {keys[i][0] for i in changed}:
                first = self._first[name]
                if lines[first] != before[first]:  # (else: only a later line changed)
                    key = (lines[first], self._parts[name])
                    nodes[self._at[name]] = _node(name, key, seen_gres)
        self._lines, self._nodes = lines, nodes
        return nodes

    def _read_all(self, lines: list[str]) -> list[NodeInfo]:
        seen = dict(zip(self._lines, self._keys, strict=True))  # read in the previous listing
        keys: list[LineKey] = []
        first: dict[str, int] = {}
        parts: dict[str, list[str]] = {}
        for i, line in enumerate(lines):
            key = seen.get(line) or _line_key(line)
            keys.append(key)
            name, partition = key
            held = parts.get(name)
            if held is None:
                first[name] = i
                parts[name] = [partition]
            elif partition in held:
                raise _bad(WHAT_SINFO, line, f"node {name} twice in partition {partition}")
            else:
                held.append(partition)
        seen_gres: dict[str, Gres] = {}
        before, first_before, parts_before = self._lines, self._first, self._parts
        nodes_before, at_before = self._nodes, self._at
        names = sorted(first)
        nodes: list[NodeInfo] = []
        parts_of: dict[str, tuple[str, ...]] = {}
        for name in names:
            line, partitions = lines[first[name]], tuple(parts[name])
            parts_of[name] = partitions
            at = at_before.get(name)
            if (
                at is not None
                and before[first_before[name]] == line
                and parts_before[name] == partitions
            ):
                nodes.append(nodes_before[at])
            else:
                nodes.append(_node(name, (line, partitions), seen_gres))
        self._lines, self._keys, self._first, self._parts = lines, keys, first, parts_of
        self._nodes, self._at = nodes, dict(zip(names, range(len(names)), strict=True))
        return nodes


def _line_key(line: str) -> LineKey:
    """A ``sinfo`` line's node and partition, if it is a node line (else SlurmParseError)."""
    fields = line.split(SEP)
    width = len(SINFO_FIELDS)
    if len(fields) < width:
        raise _bad(WHAT_SINFO, line, f"{len(fields)} fields, not {width}")
    name, partition = fields[0], fields[3]
    if not name or fields[-1] != name or not partition:
        raise _bad(WHAT_SINFO, line, "not a node line")
    return name, partition


def _node(name: str, key: NodeKey, seen_gres: dict[str, Gres]) -> NodeInfo:
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
        raise _bad(WHAT_SINFO, line, f"CPUs {cpus_state!r}")
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
Details = Mapping[int, tuple[str, ...]]  # job id -> gres detail per node (xhpc.slurm.details)


class SqueueReader:
    """Reads successive ``squeue -O`` listings (:data:`SQUEUE_FIELDS`); see the module doc.

    It keeps the previous listing's lines and jobs. A listing of as many lines, each equal to
    the previous one's at the same place or naming the same job, names no job twice (the
    previous one did not): only the changed lines, and the jobs still without their GPU
    detail, are read. Otherwise a line of the previous listing is its job again (a dict
    lookup) and only the others are read; a line read must name a job that no other line
    names.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._jobs: tuple[JobInfo, ...] = ()  # per line
        self._waiting: list[int] = []  # the lines whose job is still without its GPU detail
        self._known: dict[str, JobInfo] = {}  # line -> job, but those waiting
        self._line_of: dict[str, str] = {}  # job id -> its line

    def read(self, text: str, details: Details | None = None) -> tuple[list[JobInfo], list[int]]:
        """The jobs in Slurm's order, and the ids of those holding an allocation whose GPU detail
        is not known yet (in neither an earlier read nor ``details``): they are listed without
        one, and read again when ``details`` has theirs."""
        lines = _lines(text)
        read = _JobRead(self._known, self._line_of, details)
        jobs = self._same_jobs(lines, read)
        if jobs is None:
            jobs = self._read_all(lines, read)
        return jobs, read.missing

    def _same_jobs(self, lines: list[str], read: _JobRead) -> list[JobInfo] | None:
        """The jobs, if each line equals the previous listing's at the same place or names the
        same job; else None."""
        before = self._lines
        if not before or len(lines) != len(before):
            return None
        changed = list(compress(range(len(lines)), map(ne, lines, before)))
        if any(lines[k].partition(SEP)[0] != before[k].partition(SEP)[0] for k in changed):
            return None
        jobs = list(self._jobs)
        waiting: list[int] = []
        for k in sorted({*changed, *self._waiting}):
            job = read.job(lines[k])
            if job is None:
                job = read.waiting[lines[k]]
                waiting.append(k)
            jobs[k] = job
        self._commit(lines, jobs, waiting, [before[k] for k in changed], read)
        return jobs

    def _read_all(self, lines: list[str], read: _JobRead) -> list[JobInfo]:
        listed = set(lines)
        if len(listed) != len(lines):
            raise _twice(lines)
        known, line_of = self._known, self._line_of
        for line in filterfalse(known.__contains__, lines):
            jid = line.partition(SEP)[0]
            other = line_of.get(jid)
            if jid in read.ids or (other is not None and other != line and other in listed):
                raise _bad(WHAT_SQUEUE, line, f"job {jid} twice")
            read.job(line)
        jobs: list[JobInfo] = []
        waiting: list[int] = []
        done = read.done
        for i, line in enumerate(lines):
            job = known.get(line) or done.get(line)
            if job is None:
                job = read.waiting[line]
                waiting.append(i)
            jobs.append(job)
        gone = list(filterfalse(listed.__contains__, self._lines))
        self._commit(lines, jobs, waiting, gone, read)
        return jobs

    def _commit(
        self,
        lines: list[str],
        jobs: list[JobInfo],
        waiting: list[int],
        gone: list[str],
        read: _JobRead,
    ) -> None:
        """Keep this listing: forget the lines ``gone`` from the previous one, add those read."""
        known, line_of = self._known, self._line_of
        for line in gone:
            jid = line.partition(SEP)[0]
            if line_of.get(jid) == line:
                del line_of[jid]
            known.pop(line, None)
        known.update(read.done)
        line_of.update(read.ids)
        self._lines, self._jobs, self._waiting = lines, tuple(jobs), waiting


class _JobRead:
    """One read's lines read: their jobs, each with the GPU detail of its run (from the
    previous listing, or the ``details`` given), and what the reader keeps of them."""

    def __init__(
        self, known: Mapping[str, JobInfo], line_of: Mapping[str, str], details: Details | None
    ) -> None:
        self.known, self.line_of, self.details = known, line_of, details
        self.started: dict[str, datetime] = {}
        self.missing: list[int] = []  # the jobs without their GPU detail
        self.ids: dict[str, str] = {}  # job id -> line
        self.done: dict[str, JobInfo] = {}  # line -> job (complete)
        self.waiting: dict[str, JobInfo] = {}  # line -> job (without its GPU detail)

    def job(self, line: str) -> JobInfo | None:
        """The line's job (None: it waits for its GPU detail, in ``waiting``)."""
        fields = _job_fields(line)
        jid = fields[0]
        self.ids[jid] = line
        job = _job(fields, self.started, line)
        if job.state in HOLDING_STATES:
            detail = self._detail_before(jid, line, job)
            if detail is None and self.details is not None:
                detail = self.details.get(job.raw_job_id)
            if detail is None:
                self.missing.append(job.raw_job_id)
                self.waiting[line] = job
                return None
            job = _with_detail(job, detail)
        self.done[line] = job
        return job

    def _detail_before(self, jid: str, line: str, job: JobInfo) -> tuple[str, ...] | None:
        """The GPU detail of the job's previous line, if that was the same run (the same start
        time and nodes) in an allocated state."""
        before = self.line_of.get(jid)
        if before is None or before == line:
            return None
        old = self.known.get(before)
        if (
            old is None
            or old.state not in HOLDING_STATES
            or old.start_time != job.start_time
            or old.nodes != job.nodes
        ):
            return None
        return old.gres_detail


def _job_fields(line: str) -> list[str]:
    """A ``squeue`` line's fields, if it is a job line (else SlurmParseError)."""
    fields = line.split(SEP)
    width = len(SQUEUE_FIELDS)
    if len(fields) != width or fields[0] != fields[-1] or not fields[0].isdigit():
        raise _bad(WHAT_SQUEUE, line, f"not a job line of {width} fields")
    return fields


def _twice(lines: list[str]) -> SlurmParseError:
    """The error for a listing holding a line twice."""
    seen: set[str] = set()
    for line in lines:
        if line in seen:
            return _bad(WHAT_SQUEUE, line, f"job {_job_fields(line)[0]} twice")
        seen.add(line)
    raise AssertionError("no line twice")


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


def _job(fields: list[str], started: dict[str, datetime], line: str) -> JobInfo:
    (jid_text, state, het_text, het_off_text, arr_text, task_text, user, partition, nodes) = fields[
        :9
    ]
    batch_host, batch_flag, limit, start_text, restarts, reason, name, comment = fields[9:17]
    jid = int(jid_text)
    if not state or not state.replace("_", "").isalpha():
        raise _bad(WHAT_SQUEUE, line, f"job state {state!r}")
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
