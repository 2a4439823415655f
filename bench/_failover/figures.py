"""bench/failover.py's figures (pure): its targets, and the table it prints from what a run
recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench._common import target_lines

CONTENDERS = ("one address", "both addresses")
TAKEOVER_S = 10.0
TARGET_TAKEOVER = f"the standby leads within {TAKEOVER_S:g} s of the login node's death"
TARGET_FAILED = "0 failed calls for a client of both addresses"
TARGET_JOBS = "0 duplicate or lost jobs"
TARGET_REPLACED = "the replacement due during the outage happens"
TARGET_FENCED = "the frozen former leader is fenced (exit 4, nothing submitted)"
TARGET_RELAYED = "the gateway of the standby's login node serves (its broker relays)"
TARGET_WOKEN = "the wake due during the outage happens (the held call answered)"
TARGET_HANDOVER = "the walltime handover due during the outage happens (before the job's end)"
STANDBY_CALLS = 10


@dataclass
class Call:
    contender: str
    at: float  # seconds from the run's start
    took: float
    error: str  # "" when the answer was whole


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    calls = [c for c in data.get("calls", []) if c["contender"] == "both addresses"]
    failed = [c for c in calls if c["error"]]
    took = data.get("takeover_s")
    jobs = data.get("jobs", {})
    dup, lost = jobs.get("duplicates"), jobs.get("lost")
    fenced = data.get("fenced", {})
    standby = data.get("standby_gateway", {})
    woken = data.get("woken_s")
    handover = data.get("handover", {})
    return [
        {"target": TARGET_TAKEOVER, "value": "never" if took is None else f"{took:.1f} s",
         "met": took is not None and took <= TAKEOVER_S},
        {"target": TARGET_FAILED, "value": f"{len(failed)} of {len(calls)}",
         "met": bool(calls) and not failed},
        {"target": TARGET_JOBS, "value": f"{dup} duplicate, {lost} lost",
         "met": dup == 0 and lost == 0},
        {"target": TARGET_REPLACED,
         "value": "no" if data.get("replaced_s") is None else f"READY {data['replaced_s']:.0f} s "
         "after the cancel", "met": data.get("replaced_s") is not None},
        {"target": TARGET_FENCED,
         "value": f"exit {fenced.get('exit')}, {fenced.get('submitted', '?')} submitted",
         "met": fenced.get("exit") == 4 and fenced.get("submitted") == 0},
        {"target": TARGET_RELAYED,
         "value": f"{standby.get('answered', 0)} of {STANDBY_CALLS} answered, "
         f"{'relayed' if standby.get('relayed') else 'not relayed'}",
         "met": standby.get("answered") == STANDBY_CALLS and standby.get("relayed") is True},
        {"target": TARGET_WOKEN,
         "value": "no" if woken is None else f"answered {woken:.0f} s after the node's death",
         "met": woken is not None},
        {"target": TARGET_HANDOVER, "value": _handover_value(handover),
         "met": handover.get("by_new_leader") is True and handover.get("ready_left_s") is not None
         and handover["ready_left_s"] > 0},
    ]  # fmt: skip


def _handover_value(handover: dict[str, Any]) -> str:
    left = handover.get("ready_left_s")
    if left is None:
        return "no successor READY"
    who = "the new leader" if handover.get("by_new_leader") else "the leader before the outage"
    return f"successor submitted by {who}, READY {left:.0f} s before the job's end"


def table(data: dict[str, Any]) -> str:
    calls = data.get("calls", [])
    rows = []
    for label, pick in (
        ("calls answered", lambda cs: sum(1 for c in cs if not c["error"])),
        ("failed calls", lambda cs: sum(1 for c in cs if c["error"])),
        ("slowest answered call (s)",
         lambda cs: f"{max((c['took'] for c in cs if not c['error']), default=0):.1f}"),
    ):  # fmt: skip
        cells = [str(pick([c for c in calls if c["contender"] == k])) for k in CONTENDERS]
        rows.append(f"| {label} | {' | '.join(cells)} |")
    took, freeze = data.get("takeover_s"), data.get("freeze_takeover_s")
    replaced, jobs, fenced = data.get("replaced_s"), data.get("jobs", {}), data.get("fenced", {})
    woken = data.get("woken_s")
    lines = [
        "Calls through the outage of a login node (its link cut, everything on it killed)",
        "",
        f"| figure | {' | '.join(CONTENDERS)} |",
        "|---|---|---|",
        *rows,
        "",
        "| control plane | |",
        "|---|---|",
        f"| login node killed: the standby leads after (s) | "
        f"{'never' if took is None else f'{took:.1f}'} |",
        f"| a replica's job cancelled meanwhile: READY again after (s) | "
        f"{'never' if replaced is None else round(replaced)} |",
        f"| a call to an asleep deployment meanwhile: answered after (s) | "
        f"{'never' if woken is None else round(woken)} |",
        f"| a job's walltime handover due meanwhile | "
        f"{_handover_value(data.get('handover', {}))} |",
        f"| jobs: duplicate, lost | {jobs.get('duplicates')}, {jobs.get('lost')} |",
        f"| leader frozen: the standby leads after (s) | "
        f"{'never' if freeze is None else f'{freeze:.1f}'} |",
        f"| the frozen one resumed: exit, jobs it submitted | {fenced.get('exit')}, "
        f"{fenced.get('submitted')} |",
        f"| before: calls answered by the standby's login node's gateway (relayed) | "
        f"{data.get('standby_gateway', {}).get('answered')} of {STANDBY_CALLS} |",
        "",
        *target_lines(data.get("targets", [])),
    ]  # fmt: skip
    return "\n".join(lines)
