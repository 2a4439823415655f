"""`xhpc probe`: sample this node's GPUs, CPU and memory; print them or report to the broker."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from xhpc.broker.probes import PROBE_TOKEN_FILE
from xhpc.broker.server import broker_file_path
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.models import GpuProbe, ProbeReport, check_name
from xhpc.probe import HostSampler, ProbeSettings, open_backend, run_probe, sample


def _node_name(value: str | None) -> str:
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


def _print_report(ctx: Ctx, report: ProbeReport) -> None:
    console = ctx.console
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


@click.command("probe")
@click.option("--once", is_flag=True, help="Print one snapshot and exit; contacts no broker.")
@click.option("--json", "as_json", is_flag=True, help="With --once: the report as JSON.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "nvml", "fake"]),
    default="auto",
    show_default=True,
    help="GPU backend; auto: NVML when the driver answers, else fake.",
)
@click.option(
    "--fake-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="TOML/JSON file describing fake GPUs (re-read at every sample).",
)
@click.option(
    "--fake-gpus",
    type=click.IntRange(0, 1024),
    default=0,
    show_default=True,
    help="Idle fake GPUs when there is no --fake-file.",
)
@click.option("--node", "node", default=None, help="Node name to report as (default: hostname).")
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds between reports.",
)
@click.option(
    "--broker-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The broker's address file (default: <state_dir>/broker.json).",
)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File holding this node's token for the broker (required unless --once).",
)
@click.option(
    "--proc-root",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("/proc"),
    hidden=True,
    help="Where to look up GPU processes' Slurm jobs (tests).",
)
@pass_ctx
def probe(
    ctx: Ctx,
    once: bool,
    as_json: bool,
    backend: str,
    fake_file: Path | None,
    fake_gpus: int,
    node: str | None,
    interval_s: float,
    broker_file: Path | None,
    token_file: Path | None,
    proc_root: Path,
) -> None:
    """Sample this node's GPUs (NVML or fake), CPU and memory, and report them to the broker."""
    if as_json and not once:
        raise click.UsageError("--json goes with --once")
    name = _node_name(node)
    settings = ProbeSettings.model_validate(
        {
            "backend": backend,
            "interval_s": interval_s,
            "fake_file": fake_file,
            "fake_gpus": fake_gpus,
            "proc_root": proc_root,
            "broker_file": broker_file,
            "token_file": token_file,
        }
    )
    # The broker keeps the node token in its state directory (owner-only); sites that run the
    # probe as another user hand it a copy with --token-file.
    token = settings.token_file or ctx.config.probe.token_file
    if token is None:
        token = ctx.config.resolved_state_dir / PROBE_TOKEN_FILE
    # A daemon started before the broker waits for the token file (logged once).
    gpus = open_backend(settings)
    try:
        if once or token is None:
            report = sample(name, gpus, HostSampler())
            if as_json:
                emit_json(report.model_dump(mode="json"))
            else:
                _print_report(ctx, report)
            return
        logging.getLogger().setLevel(logging.INFO)
        asyncio.run(
            run_probe(
                name,
                gpus,
                settings.broker_file or broker_file_path(ctx.config),
                token,
                settings.interval_s,
                timeout_s=settings.post_timeout_s,
            )
        )
    finally:
        gpus.close()
