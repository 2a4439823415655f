"""Parsers for Slurm CLI output (pure). Fed with output captured from the real dev cluster.

``sinfo``/``squeue --json`` at 10k nodes is tens of MB, so the two JSON parsers are written for
speed (``bench/placement.py``): the text is decoded with msgspec into records of only the fields
read here (the ~100 others are skipped without building Python objects), each field's value as
``json.loads`` would give it; GRES strings are parsed once per distinct string. A node becomes a
:class:`NodeInfo` (a pydantic model: the API sends nodes), a job a :class:`JobInfo` (a msgspec
struct: one per job of the whole cluster, every poll, and never sent)."""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec

from xhpc.errors import SlurmParseError
from xhpc.models import JobInfo, NodeInfo

_GRES_ITEM = re.compile(
    r"^(?P<name>[^:()]+)(?::(?P<type>[^:()]+))?(?::(?P<count>\d+))?(?:\((?P<extra>[^)]*)\))?$"
)
_NO_VAL = {4294967294, 4294967295, 65534, 65535}


def _split_top(text: str) -> list[str]:
    """Split "gpu:2(IDX:0,2),mps:1" on commas outside parentheses."""
    if "(" not in text and ")" not in text:
        return [p.strip() for p in text.split(",") if p.strip()]
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return [p.strip() for p in out if p.strip()]


def parse_index_list(text: str) -> tuple[int, ...]:
    """ "0-1,3" -> (0, 1, 3); "N/A" -> ()."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part or part.upper() == "N/A":
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
        except ValueError as err:
            raise SlurmParseError(f"cannot read GPU index list {text!r}") from err
    return tuple(out)


Gres = tuple[int, str | None, tuple[int, ...]]


@functools.lru_cache(maxsize=4096)
def parse_gres(text: str | None, name: str = "gpu") -> Gres:
    """A GRES string -> (count, type, indexes) for ``name``.

    Handles "gpu:4", "gpu:a100:4(S:0-1)", "gpu:2(IDX:0-1)", "gpu:a100:0(IDX:N/A)", "gpu(IDX:0)".
    A cluster prints few distinct strings (every node "gpu:8"), so results are remembered.
    """
    if not text:
        return 0, None, ()
    return _parse_gres(text, name)


def _parse_gres(text: str, name: str) -> Gres:
    count: int = 0
    gtype: str | None = None
    idx: tuple[int, ...] = ()
    if not text or text in ("(null)", "N/A"):
        return 0, None, ()
    for item in _split_top(text):
        m = _GRES_ITEM.match(item)
        if not m or m.group("name") != name:
            continue
        raw_type, raw_count = m.group("type"), m.group("count")
        if raw_count is None and raw_type is not None and raw_type.isdigit():
            raw_type, raw_count = None, raw_type
        extra = m.group("extra") or ""
        these: tuple[int, ...] = ()
        for field in extra.split("|") if extra else []:
            if field.startswith("IDX:"):
                these = parse_index_list(field[4:])
        n = int(raw_count) if raw_count is not None else len(these)
        count += n
        gtype = gtype or raw_type
        idx = (*idx, *these)
    return count, gtype, idx


def _number(value: Any) -> int | None:
    """Slurm 22.05 prints plain ints; later versions print {"set": bool, "number": int}."""
    if type(value) is int:
        return None if value in _NO_VAL else value
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return None if int(value) in _NO_VAL else int(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _text(value: Any) -> str | None:
    if type(value) is str:
        return value if value and value != "(null)" else None
    if value is None:
        return None
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or None
    s = str(value)
    return s if s and s != "(null)" else None


def _state(value: Any) -> tuple[str, tuple[str, ...]]:
    if isinstance(value, list):
        states = [str(v).upper() for v in value]
        return (states[0] if states else "UNKNOWN"), tuple(states[1:])
    return str(value or "UNKNOWN").upper(), ()


# -- the records: only the fields read below; any value shape (Slurm versions differ) -------------
class _SinfoNode(msgspec.Struct, gc=False):
    name: Any = None
    hostname: Any = None
    address: Any = None
    state: Any = None
    state_flags: Any = None
    partitions: Any = None
    gres: Any = None
    gres_used: Any = None
    cpus: Any = None
    reason: Any = None


class _Sinfo(msgspec.Struct, gc=False):
    nodes: list[_SinfoNode] | None = None


class _SqueueJob(msgspec.Struct, gc=False):
    job_id: Any = None
    job_state: Any = None
    gres_detail: Any = None
    het_job_id: Any = None
    het_job_offset: Any = None
    array_job_id: Any = None
    array_task_id: Any = None
    array_task_string: Any = None
    state_reason: Any = None
    name: Any = None
    user_name: Any = None
    partition: Any = None
    nodes: Any = None
    batch_host: Any = None
    comment: Any = None
    time_limit: Any = None
    start_time: Any = None
    restart_cnt: Any = None


class _Squeue(msgspec.Struct, gc=False):
    jobs: list[_SqueueJob] | None = None


_SINFO = msgspec.json.Decoder(_Sinfo)
_SQUEUE = msgspec.json.Decoder(_Squeue)
D = TypeVar("D")


def _load(decoder: msgspec.json.Decoder[D], text: str, what: str) -> D:
    try:
        return decoder.decode(text)
    except msgspec.ValidationError as err:  # valid JSON, not Slurm's shape
        if text.lstrip()[:1] != "{":
            raise SlurmParseError(
                f"{what} printed JSON that is not an object", stdout=text[:2000]
            ) from err
        raise SlurmParseError(f"{what} printed unexpected JSON: {err}", stdout=text[:2000]) from err
    except (msgspec.DecodeError, UnicodeError) as err:  # (UnicodeError: a lone surrogate)
        raise SlurmParseError(f"{what} did not print JSON: {err}", stdout=text[:2000]) from err


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """``sinfo --json`` -> one :class:`NodeInfo` per node (the first of a name), by name."""
    data = _load(_SINFO, text, "sinfo --json")
    nodes: dict[str, NodeInfo] = {}
    text_of, state_of, number, gres = _text, _state, _number, parse_gres
    seen_gres: dict[str, Gres] = {}  # the raw string -> parse_gres(_text(string))
    for raw in data.nodes or ():
        name = text_of(raw.name) or text_of(raw.hostname)
        if not name or name in nodes:
            continue
        value = raw.state
        extra_flags: tuple[str, ...] = ()
        if type(value) is str:  # Slurm 22.05; later versions print a list
            state = value.upper() if value else "UNKNOWN"
        else:
            state, extra_flags = state_of(value)
        value = raw.state_flags
        flags = tuple([str(f).upper() for f in value]) if value else ()
        if extra_flags:
            flags += extra_flags
        value = raw.gres
        parsed = seen_gres.get(value) if type(value) is str else None
        if parsed is None:
            parsed = gres(text_of(value))
            if type(value) is str:
                seen_gres[value] = parsed
        total, gtype, _ = parsed
        value = raw.gres_used
        parsed = seen_gres.get(value) if type(value) is str else None
        if parsed is None:
            parsed = gres(text_of(value))
            if type(value) is str:
                seen_gres[value] = parsed
        used, _, used_idx = parsed
        value = raw.partitions
        cpus = raw.cpus
        nodes[name] = NodeInfo(
            name=name,
            address=text_of(raw.address) or name,
            state=state,
            state_flags=flags,
            partitions=tuple(map(str, value)) if value else (),
            gpus_total=total,
            gpus_used=used,
            gpu_type=gtype,
            gpus_used_idx=used_idx,
            cpus=(cpus if type(cpus) is int and cpus not in _NO_VAL else number(cpus)) or 0,
            reason=text_of(raw.reason),
        )
    return [nodes[name] for name in sorted(nodes)]


def parse_squeue_json(text: str) -> list[JobInfo]:
    """``squeue --json`` -> one :class:`JobInfo` per record, in Slurm's order (each field
    computed here with its declared type: a struct, not validated again)."""
    data = _load(_SQUEUE, text, "squeue --json")
    jobs: list[JobInfo] = []
    text_of, state_of, number, gres, no_val = _text, _state, _number, parse_gres, _NO_VAL
    started: dict[int, datetime] = {}
    for raw in data.jobs or ():
        value = raw.job_state
        if type(value) is str:  # Slurm 22.05; later versions print a list
            state = value.upper() if value else "UNKNOWN"
        else:
            state, _ = state_of(value)
        value = raw.gres_detail
        details = tuple(map(str, value)) if value else ()
        idx: tuple[int, ...] = ()
        if len(details) == 1:
            idx = gres(details[0])[2]
        else:
            for d in details:
                idx = (*idx, *gres(d)[2])
        # the job id (plain, het component, array task, pending array), numbers read inline
        value = raw.job_id
        jid = value if type(value) is int and value not in no_val else number(value)
        if jid is None:
            raise SlurmParseError("squeue --json: a job without job_id")
        # (het_job_offset and array_task_id only matter, and are only read, for het / array jobs)
        value = raw.het_job_id
        het = value if type(value) is int and value not in no_val else number(value)
        het_off = None
        if het:
            value = raw.het_job_offset
            het_off = value if type(value) is int and value not in no_val else number(value)
        value = raw.array_job_id
        arr = value if type(value) is int and value not in no_val else number(value)
        task = None
        if arr:
            value = raw.array_task_id
            task = value if type(value) is int and value not in no_val else number(value)
        if het and het_off is not None:
            job_id = f"{het}+{het_off}"
        elif arr and task is not None:
            job_id = f"{arr}_{task}"
        else:
            pending_tasks = text_of(raw.array_task_string) if arr else None
            job_id = f"{arr}_[{pending_tasks}]" if pending_tasks else str(jid)
        reason = text_of(raw.state_reason)
        value = raw.time_limit
        limit = value if type(value) is int and value not in no_val else number(value)
        value = raw.start_time
        start = value if type(value) is int and value not in no_val else number(value)
        start_time = None
        if start:
            start_time = started.get(start)
            if start_time is None:
                start_time = started[start] = datetime.fromtimestamp(start, UTC)
        value = raw.restart_cnt
        restarts = value if type(value) is int and value not in no_val else number(value)
        jobs.append(
            JobInfo(
                job_id=job_id,
                raw_job_id=jid or 0,
                name=text_of(raw.name) or "",
                state=state,
                reason=None if reason in (None, "None") else reason,
                user=text_of(raw.user_name),
                partition=text_of(raw.partition),
                nodes=text_of(raw.nodes),
                batch_host=text_of(raw.batch_host),
                comment=text_of(raw.comment),
                gpus_idx=idx,
                gres_detail=details,
                het_job_id=het or None,
                het_job_offset=het_off,
                array_job_id=arr or None,
                array_task_id=task,
                time_limit_min=limit,
                start_time=start_time,
                restart_count=restarts or 0,
            )
        )
    return jobs


def parse_sbatch_parsable(text: str) -> str:
    """`sbatch --parsable` prints "jobid" or "jobid;cluster" (het jobs: the leader's id)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise SlurmParseError("sbatch --parsable printed nothing", stdout=text)
    first = lines[-1].split(";", 1)[0]
    if not re.fullmatch(r"\d+", first):
        raise SlurmParseError(f"sbatch --parsable printed {first!r}, not a job id", stdout=text)
    return first
