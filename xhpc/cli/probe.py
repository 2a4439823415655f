"""`xhpc probe`'s output: the node's name and one report as a table.

The command itself samples with xhpc.probe, so it is in xhpc.cli.daemons.
"""

from __future__ import annotations

import socket

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from xhpc.models import GpuProbe, ProbeReport, check_name


def node_name(value: str | None) -> str:
    name = value or socket.gethostname()
    try:
        return check_name(name, "node name")
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--node") from err


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _memory(gpu: GpuProbe) -> str:
    if gpu.mem_used_mb is None and gpu.mem_total_mb is None:
        return "-"
    return f"{_num(gpu.mem_used_mb)} / {_num(gpu.mem_total_mb)}"


def _processes(gpu: GpuProbe) -> str:
    parts = [
        f"{p.pid} ({'job ' + p.job_id if p.job_id else 'foreign'}, {_num(p.mem_used_mb)} MiB)"
        for p in gpu.processes
    ]
    return ", ".join(parts) or "-"


def print_report(console: Console, report: ProbeReport) -> None:
    host = (
        f"node {escape(report.node)} · backend {report.backend} · "
        f"cpu {_num(report.cpu_pct)}% · memory {_num(report.mem_used_mb)} / "
        f"{_num(report.mem_total_mb)} MiB · {report.taken_at:%Y-%m-%d %H:%M:%S} UTC"
    )
    console.print(host)
    table = Table()
    for col in ("gpu", "name", "memory MiB", "util %", "temp °C", "health", "processes"):
        table.add_column(col)
    for gpu in report.gpus:
        health = "ok" if gpu.healthy else "[red]UNHEALTHY[/red]"
        if gpu.error:
            health += f" {escape(gpu.error)}"
        table.add_row(
            str(gpu.index),
            escape(gpu.name or "-"),
            _memory(gpu),
            _num(gpu.util_pct),
            _num(gpu.temp_c),
            health,
            escape(_processes(gpu)),
        )
    console.print(table)
    for error in report.errors:
        console.print(f"[yellow]unreadable[/yellow] {escape(error)}")
