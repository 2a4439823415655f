"""Figures to the table, pure: one row per scenario from its recorded figures, the targets of
the scenarios that ran (each with its figure and whether it is met; a scenario that failed meets
none of its own), and the summary: the markdown printed and the figures ``--json`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench._common import Summary

from .params import (
    BROKER_DOWN_S,
    CTLD_DOWN_S,
    LABELS,
    NAMES,
    NO_TRAFFIC,
    POLL_S,
    TARGET_CRASH_ATTEMPTS,
    TARGET_NODE_RESTORE_EXTRA_S,
    TARGET_NODE_ROTATION_S,
    WALLTIME_HANDOVERS,
)


def fmt_s(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _failed_total(rec: dict[str, Any]) -> int | None:
    failed = rec.get("failed")
    return None if failed is None else int(failed["plain"]) + int(failed["stream"])


def _sent_total(rec: dict[str, Any]) -> int | None:
    sent = rec.get("sent")
    return None if sent is None else int(sent["plain"]) + int(sent["stream"])


def row(rec: dict[str, Any]) -> str:
    """One table row from one scenario's figures."""
    label = LABELS.get(rec["scenario"], rec["scenario"])
    if rec["scenario"] == "broker-kill" and rec.get("broker_down_s") is not None:
        label = f"{label} {rec['broker_down_s']:.0f} s"
    sent, failed = rec.get("sent"), rec.get("failed")
    if sent is None or failed is None:
        requests = fails = truncated = "—"
    else:
        requests = f"{sent['plain']} / {sent['stream']}"
        fails = f"{failed['plain']} / {failed['stream']}"
        truncated = str(rec.get("truncated", 0))
    if rec.get("victim") is None:
        rotation = "—"
    elif rec.get("out_of_rotation_s") is None:
        rotation = "never left"
    else:
        rotation = fmt_s(rec["out_of_rotation_s"])
        extra = rec.get("out_of_rotation_after_connect_s")
        if extra is not None:
            rotation += f" ({extra:.1f} after the first failed connect)"
    if "dropped" not in rec:
        capacity = "—"
    elif not rec["dropped"]:
        capacity = "no drop"
    elif rec.get("restored_s") is None:
        capacity = "not restored"
    else:
        capacity = fmt_s(rec["restored_s"])
    extra_jobs = "—" if rec.get("extra_jobs") is None else str(rec["extra_jobs"])
    leaked = "—" if rec.get("leaked_jobs") is None else str(rec["leaked_jobs"])
    notes = list(rec.get("notes") or [])
    if rec.get("error"):
        notes.insert(0, f"ERROR: {str(rec['error'])[:160]}")
    note = "; ".join(notes).replace("|", "/") or ""
    return (
        f"| {label} | {requests} | {fails} | {truncated} | {rotation} | {capacity} "
        f"| {extra_jobs} | {leaked} | {note} |"
    )


def _target(target: str, value: str, met: bool) -> dict[str, Any]:
    return {"target": target, "value": value, "met": bool(met)}


def evaluate_targets(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the scenarios that ran, each with its figure and whether it is met. A
    scenario that failed (``error``) meets none of its targets."""
    by = {r["scenario"]: r for r in records}
    out: list[dict[str, Any]] = []

    def err(rec: dict[str, Any]) -> str:
        return f"; scenario failed: {str(rec['error'])[:120]}" if rec.get("error") else ""

    if (r := by.get("walltime")) is not None:
        failed, sent = _failed_total(r), _sent_total(r)
        handovers = int(r.get("handovers") or 0)
        out.append(
            _target(
                f"walltime boundary: 0 failed requests, plain and stream "
                f"({WALLTIME_HANDOVERS} handovers)",
                f"{failed} of {sent} failed, {handovers} handovers{err(r)}",
                not r.get("error") and failed == 0 and handovers >= WALLTIME_HANDOVERS,
            )
        )
    if (r := by.get("proxy-worker-kill")) is not None:
        failed = _failed_total(r)
        held = r.get("in_flight_at_killed_worker")
        after = r.get("failed_after_kill")
        out.append(
            _target(
                "proxy worker kill -9: only the requests in flight at that worker fail",
                f"{failed} failed; the killed worker held {held} client connection(s); "
                f"{after} failed among those sent after the kill{err(r)}",
                not r.get("error")
                and failed is not None
                and held is not None
                and after == 0
                and failed <= held,
            )
        )
    if (r := by.get("proxy-reload")) is not None:
        failed, sent = _failed_total(r), _sent_total(r)
        out.append(
            _target(
                "proxy reload (SIGHUP): 0 failed requests",
                f"{failed} of {sent} failed{err(r)}",
                not r.get("error") and failed == 0,
            )
        )
    with_traffic = [r for r in records if r["scenario"] not in NO_TRAFFIC]
    if with_traffic:
        truncated = {r["scenario"]: int(r.get("truncated") or 0) for r in with_traffic}
        total = sum(truncated.values())
        where = ", ".join(f"{k} {v}" for k, v in truncated.items() if v)
        out.append(
            _target(
                "no truncated 200 in any scenario",
                f"{total} in {len(with_traffic)} scenario(s)" + (f" ({where})" if where else ""),
                total == 0,
            )
        )
    if (r := by.get("broker-kill")) is not None:
        failed = _failed_total(r)
        relaunches, dups = r.get("relaunches"), r.get("duplicate_jobs")
        out.append(
            _target(
                "broker kill -9 and outage: 0 failed, 0 relaunches, 0 duplicate jobs",
                f"down {fmt_s(r.get('broker_down_s'), 0)} s: {failed} failed, {relaunches} "
                f"relaunches, {dups} duplicate jobs, {r.get('lost_transitions')} "
                f"transitions to LOST{err(r)}",
                not r.get("error") and failed == 0 and relaunches == 0 and dups == 0,
            )
        )
    if (r := by.get("requeue")) is not None:
        after = r.get("failed_after_left_running")
        out.append(
            _target(
                "requeue: 0 requests failed after the job left RUNNING",
                f"{after} failed of those sent after squeue showed the job leave RUNNING "
                f"(+{fmt_s(r.get('left_running_s'))} s); {_failed_total(r)} failed in all{err(r)}",
                not r.get("error") and after == 0,
            )
        )
    if (r := by.get("node-loss")) is not None:
        rot = r.get("out_of_rotation_s")
        first = r.get("first_failed_connect_s")
        if rot is None:
            value, met = "the replica never left the routing table", False
        elif first is not None:
            since = rot - first
            value = (
                f"{since:.1f} s (the route left the table {rot:.1f} s after the fault; first "
                f"failed connect +{first:.1f} s, {r.get('first_failed_connect_from')})"
            )
            met = since <= TARGET_NODE_ROTATION_S
        else:
            value = f"{rot:.1f} s after the fault (raw: no failed connect observed to subtract)"
            met = rot <= TARGET_NODE_ROTATION_S
        out.append(
            _target(
                f"node loss: out of rotation ≤ {TARGET_NODE_ROTATION_S:.0f} s after the first "
                "failed connect",
                value + err(r),
                met and not r.get("error"),
            )
        )
        back, start = r.get("restored_s"), r.get("replacement_start_s")
        if back is None or start is None:
            value, met = "no replacement READY seen (or no submit time)", False
        else:
            value = (
                f"capacity restored {back:.1f} s after the fault; the replacement's queue wait "
                f"+ engine start {start:.1f} s (submitted "
                f"+{fmt_s(r.get('replacement_submitted_s'))} s)"
            )
            met = back <= start + TARGET_NODE_RESTORE_EXTRA_S
        out.append(
            _target(
                "node loss: replacement READY within its queue wait + engine start + "
                f"{TARGET_NODE_RESTORE_EXTRA_S:.0f} s",
                value + err(r),
                met and not r.get("error"),
            )
        )
        failed = r.get("failed")
        plain = None if failed is None else failed["plain"]
        out.append(
            _target(
                "node loss: 0 plain requests failed",
                f"{plain} of {None if r.get('sent') is None else r['sent']['plain']} plain "
                f"failed ({None if failed is None else failed['stream']} streams){err(r)}",
                not r.get("error") and plain == 0,
            )
        )
    if (r := by.get("ctld-outage")) is not None:
        failed = _failed_total(r)
        transitions = r.get("transitions_during_outage")
        out.append(
            _target(
                "slurmctld down 60 s: 0 failed, 0 false transitions",
                f"{failed} failed, {transitions} transition lines during the outage{err(r)}",
                not r.get("error") and failed == 0 and transitions == 0,
            )
        )
    if (r := by.get("crash-loop")) is not None:
        attempts = r.get("attempts")
        failed_dep = bool(r.get("deployment_failed"))
        out.append(
            _target(
                f"crash loop: ≤ {TARGET_CRASH_ATTEMPTS} attempts, then FAILED",
                f"{attempts} replacement start(s), "
                f"{'then FAILED' if failed_dep else 'not FAILED'}{err(r)}",
                not r.get("error")
                and failed_dep
                and attempts is not None
                and attempts <= TARGET_CRASH_ATTEMPTS,
            )
        )
    return out


HEADER = (
    "| scenario | requests plain / stream | failed plain / stream | truncated 200s "
    "| out of rotation s | capacity restored s | extra jobs | leaked jobs | notes |"
)


def summarize(records: Sequence[dict[str, Any]], params: dict[str, Any]) -> Summary:
    lines: list[str] = []
    out = lines.append
    out(
        "## Continuity under faults: dev cluster, tiny model, transformers engine, steady "
        "traffic through `xhpc proxy`"
    )
    out("")
    out(
        "2 traffic threads (plain and streamed requests alternately, every answer checked); "
        "[lifecycle] backoff_s = 1, lost_grace_s = 20 (walltime: 3-minute jobs, "
        f"handover_floor_s = 120); broker down {params.get('broker_down_s', BROKER_DOWN_S):.0f} s; "
        f"slurmctld down {CTLD_DOWN_S:.0f} s. Times in s from the fault; the broker's routes and "
        f"replicas sampled every {POLL_S} s."
    )
    out("")
    out(HEADER)
    out("|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        out(row(rec))
    targets = evaluate_targets(records)
    out("")
    out("### Targets")
    out("")
    out("| target | value | met |")
    out("|---|---|---|")
    for t in targets:
        met = "yes" if t["met"] else "**no**"
        out(f"| {t['target']} | {t['value'].replace('|', '/')} | {met} |")
    ran = {r["scenario"] for r in records}
    not_run = [n for n in NAMES if n not in ran]
    if not_run:
        out("")
        out(f"Not run: {', '.join(not_run)}.")
    data = {"params": dict(params), "scenarios": list(records), "targets": targets}
    return Summary("\n".join(lines), data)
