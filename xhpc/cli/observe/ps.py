"""`xhpc ps`: the replicas (or the pilot jobs) as the broker lists them.

It prints the broker's answers as they come (xhpc/broker/api.py dumps ReplicaView, DeploymentView
and PilotView with pydantic; `--json` passes them on): no config and no model is built, so that it
answers fast (BROKER_ONLY in xhpc/cli/main.py; docs/performance.md).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table

from xhpc.cli.context import broker_of, console, emit_json
from xhpc.client.http import BrokerTransport
from xhpc.dashboard.spans import coming

Row = dict[str, Any]  # one view as the broker sent it: a JSON object with every field


def _show_pilots(broker: BrokerTransport, as_json: bool) -> None:
    pilots: list[Row] = broker.get("/v1/pilots")
    if as_json:
        emit_json(pilots)
        return
    table = Table(title="pilot jobs")
    for col in ("pilot", "node", "gpus", "state", "job", "devices", "replicas"):
        table.add_column(col)
    for p in pilots:
        table.add_row(
            p["pilot_id"],
            p["node"],
            str(p["gpus"]),
            p["state"],
            p["job_id"] or "-",
            ",".join(map(str, p["devices"])) or "-",
            ", ".join(p["replicas"]) or "-",
        )
    console().print(table)


def _endpoint(r: Row) -> str | None:
    """ReplicaView.endpoint of a replica as sent."""
    host, port = r["host"], r["port"]
    return f"http://{host}:{port}" if host and port else None


@click.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and failed replicas.")
@click.option("--pilots", "show_pilots", is_flag=True, help="List pilot jobs instead.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def ps(ctx: click.Context, show_all: bool, show_pilots: bool, as_json: bool) -> None:
    """List replicas and their states (or, with --pilots, the pilot jobs)."""
    broker = broker_of(ctx)
    if show_pilots:
        _show_pilots(broker, as_json)
        return
    rows: list[Row] = broker.get(f"/v1/replicas?all={int(show_all)}")
    if as_json:
        emit_json(rows)
        return
    out = console()
    if not rows:  # an empty table would hide replicas that ended: say how to see them
        ended = [] if show_all else broker.get("/v1/replicas?all=1")
        out.print(empty_note(ended), markup=False, highlight=False)
    else:
        out.print(replica_table(rows))
    for line in deployment_notes(broker.get("/v1/deployments")):
        out.print(line, markup=False, highlight=False)


def empty_note(ended: list[Row]) -> str:
    """What `xhpc ps` says instead of an empty table: no replica at all, or only ended ones
    (``ended``: every replica as sent, when the live ones were none)."""
    if not ended:
        return "no replicas (start one with `xhpc serve MODEL`)"
    states: dict[str, int] = {}
    for r in ended:
        states[r["state"]] = states.get(r["state"], 0) + 1
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return (
        f"no live replicas; {len(ended)} ended ({counts}): `xhpc ps --all` lists them, "
        "`xhpc logs REPLICA` shows why one ended"
    )


def _coming(r: Row, now: datetime) -> str:
    """The "next" cell of a replica as sent: its outlook (ReplicaView.outlook) read without
    pydantic."""
    out: Row | None = r.get("outlook")
    if out is None:
        return "-"
    start = out.get("start_estimate")
    return coming(
        r["state"], datetime.fromisoformat(start) if start else None, out.get("time_left_s"), now
    )


def _detail(r: Row) -> str:
    """Why it is where it is: the broker's reason, or for a queued job Slurm's pending one."""
    out: Row | None = r.get("outlook")
    pending = out.get("pending_reason") if out else None
    reason: str = r["reason"] or ""
    if pending and r["state"] == "QUEUED" and pending not in reason:
        return f"{reason} (Slurm: {pending})" if reason else f"Slurm: {pending}"
    return reason


def replica_table(rows: list[Row], now: datetime | None = None) -> Table:
    now = now or datetime.now(UTC)
    table = Table()
    for col in (
        "replica",
        "deployment",
        "role",
        "state",
        "engine",
        "job",
        "node",
        "gpus",
        "endpoint",
        "next",
        "detail",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["replica_id"],
            r["deployment"],
            f"{r['role']} of {r['unit']}" if r["role"] else "-",
            r["state"],
            r["engine"],
            r["job_id"] or "-",
            (r.get("outlook") or {}).get("node_set") or r["node"] or "-",
            ",".join(map(str, r["gpus"])) or "-",
            _endpoint(r) or "-",
            _coming(r, now),
            _detail(r),
        )
    return table


def deployment_notes(deps: list[Row]) -> list[str]:
    """One line per deployment (a DeploymentView as sent) that is not what its owner asked for:
    failed, or short of READY replicas (being replaced, waiting in the queue)."""
    lines: list[str] = []
    for d in deps:
        if d["failed_reason"]:
            lines.append(f"{d['name']}: FAILED: {d['failed_reason']}")
            continue
        replicas: list[Row] = d["replicas"]
        if any(r["role"] is not None for r in replicas):
            continue  # PD: `wanted` counts units, not instances (shown per unit in the table)
        ready = sum(r["state"] == "READY" for r in replicas)  # ReplicaState.READY's value
        wanted = d["wanted"]
        policy = d.get("scaling")
        if policy and not d["stopped"]:
            lo, hi = policy["min_replicas"], policy["max_replicas"]
            state = "asleep (a request wakes it)" if wanted == 0 else f"{wanted} wanted now"
            lines.append(f"{d['name']}: autoscaled {lo}..{hi}, {state}")
        if not d["stopped"] and wanted and ready < wanted:
            restart = d["restart"]
            lines.append(f"{d['name']}: {ready} of {wanted} replica(s) READY (restart={restart})")
    return lines
