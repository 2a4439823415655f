"""Parsers for Slurm CLI output (pure). Fed with output captured from the real dev cluster."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from xhpc.errors import SlurmParseError
from xhpc.models import JobInfo, NodeInfo

_GRES_ITEM = re.compile(
    r"^(?P<name>[^:()]+)(?::(?P<type>[^:()]+))?(?::(?P<count>\d+))?(?:\((?P<extra>[^)]*)\))?$"
)
_NO_VAL = {4294967294, 4294967295, 65534, 65535}


def _split_top(text: str) -> list[str]:
    """Split "gpu:2(IDX:0,2),mps:1" on commas outside parentheses."""
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


def parse_gres(text: str | None, name: str = "gpu") -> tuple[int, str | None, tuple[int, ...]]:
    """A GRES string -> (count, type, indexes) for ``name``.

    Handles "gpu:4", "gpu:a100:4(S:0-1)", "gpu:2(IDX:0-1)", "gpu:a100:0(IDX:N/A)", "gpu(IDX:0)".
    """
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


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SlurmParseError(f"{what} did not print JSON: {err}", stdout=text[:2000]) from err
    if not isinstance(data, dict):
        raise SlurmParseError(f"{what} printed JSON that is not an object", stdout=text[:2000])
    return data


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    data = _load(text, "sinfo --json")
    nodes: dict[str, NodeInfo] = {}
    for raw in data.get("nodes", []):
        name = _text(raw.get("name")) or _text(raw.get("hostname"))
        if not name or name in nodes:
            continue
        state, extra_flags = _state(raw.get("state"))
        flags = tuple(str(f).upper() for f in raw.get("state_flags", []) or []) + extra_flags
        total, gtype, _ = parse_gres(_text(raw.get("gres")))
        used, _, used_idx = parse_gres(_text(raw.get("gres_used")))
        nodes[name] = NodeInfo(
            name=name,
            address=_text(raw.get("address")) or name,
            state=state,
            state_flags=flags,
            partitions=tuple(str(p) for p in raw.get("partitions", []) or []),
            gpus_total=total,
            gpus_used=used,
            gpu_type=gtype,
            gpus_used_idx=used_idx,
            cpus=_number(raw.get("cpus")) or 0,
            reason=_text(raw.get("reason")),
        )
    return sorted(nodes.values(), key=lambda n: n.name)


def _job_id(raw: dict[str, Any]) -> str:
    jid = _number(raw.get("job_id"))
    if jid is None:
        raise SlurmParseError("squeue --json: a job without job_id")
    het = _number(raw.get("het_job_id"))
    het_off = _number(raw.get("het_job_offset"))
    if het and het_off is not None:
        return f"{het}+{het_off}"
    arr = _number(raw.get("array_job_id"))
    task = _number(raw.get("array_task_id"))
    if arr and task is not None:
        return f"{arr}_{task}"
    pending_tasks = _text(raw.get("array_task_string"))
    if arr and pending_tasks:
        return f"{arr}_[{pending_tasks}]"
    return str(jid)


def _time(value: Any) -> datetime | None:
    n = _number(value)
    return datetime.fromtimestamp(n, UTC) if n else None


def parse_squeue_json(text: str) -> list[JobInfo]:
    data = _load(text, "squeue --json")
    jobs: list[JobInfo] = []
    for raw in data.get("jobs", []):
        state, _ = _state(raw.get("job_state"))
        details = tuple(str(g) for g in raw.get("gres_detail", []) or [])
        idx: tuple[int, ...] = ()
        for d in details:
            idx = (*idx, *parse_gres(d)[2])
        het = _number(raw.get("het_job_id"))
        arr = _number(raw.get("array_job_id"))
        reason = _text(raw.get("state_reason"))
        jobs.append(
            JobInfo(
                job_id=_job_id(raw),
                raw_job_id=_number(raw.get("job_id")) or 0,
                name=_text(raw.get("name")) or "",
                state=state,
                reason=None if reason in (None, "None") else reason,
                user=_text(raw.get("user_name")),
                partition=_text(raw.get("partition")),
                nodes=_text(raw.get("nodes")),
                batch_host=_text(raw.get("batch_host")),
                comment=_text(raw.get("comment")),
                gpus_idx=idx,
                gres_detail=details,
                het_job_id=het or None,
                het_job_offset=_number(raw.get("het_job_offset")) if het else None,
                array_job_id=arr or None,
                array_task_id=_number(raw.get("array_task_id")) if arr else None,
                time_limit_min=_number(raw.get("time_limit")),
                start_time=_time(raw.get("start_time")),
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
