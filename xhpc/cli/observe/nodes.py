"""`xhpc nodes`: per node and per GPU, Slurm's view + the probe's view + open reservations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from xhpc.cli.context import Ctx, emit_json, pass_ctx

if TYPE_CHECKING:  # xhpc.placement imports numpy: only `xhpc nodes` pays for it
    from xhpc.placement import GpuView, NodeView, SnapshotView


def _node_json(node: NodeView) -> dict[str, Any]:
    return {
        **node.model_dump(mode="json"),
        "gpus_total": node.gpus_total,
        "allocated": node.allocated,
        "free": node.free,
        "unhealthy": node.unhealthy,
        "foreign": node.foreign,
        "probe_fresh": node.probe_fresh,
    }


def _probe_note(node: NodeView) -> str:
    if node.probe_age_s is None:
        return "no probe: Slurm data only"
    if node.probe_stale:
        return f"probe stale ({node.probe_age_s:.0f}s): Slurm data only"
    return f"probe {node.probe_age_s:.0f}s old"


def _slurm_cell(gpu: GpuView) -> str:
    if gpu.slurm_jobs:
        return "job " + ",".join(gpu.slurm_jobs)
    return "in use (no index)" if gpu.unattributed else "free"


def _probe_cell(gpu: GpuView, fresh: bool) -> str:
    if not fresh:
        return "-"
    if not gpu.healthy:
        return f"[red]UNHEALTHY[/red] {gpu.error or ''}".strip()
    parts = []
    if gpu.util_pct is not None:
        parts.append(f"{gpu.util_pct:.0f}%")
    if gpu.mem_used_mb is not None and gpu.mem_total_mb:
        parts.append(f"{gpu.mem_used_mb:.0f}/{gpu.mem_total_mb:.0f} MiB")
    if gpu.foreign:
        parts.append("[yellow]foreign process[/yellow]")
    return " ".join(parts) or "ok"


def nodes_table(snap: SnapshotView) -> Table:
    table = Table(title=f"nodes at {snap.taken_at:%H:%M:%S} UTC")
    for col in ("node", "state", "GPUs free/total", "reserved", "gpu", "Slurm", "probe"):
        table.add_column(col)
    for node in snap.nodes:
        state = "+".join((node.state, *node.state_flags))
        if node.reason:
            state += f" ({node.reason})"
        head = [
            node.name,
            state if node.usable else f"[red]{state}[/red]",
            f"{node.free}/{node.gpus_total}",
            str(node.reserved or "-"),
        ]
        for i, gpu in enumerate(node.gpus):
            first = head if i == 0 else ["", "", "", ""]
            table.add_row(
                *first, str(gpu.index), _slurm_cell(gpu), _probe_cell(gpu, node.probe_fresh)
            )
        table.add_row("", f"[dim]{_probe_note(node)}[/dim]", "", "", "", "", "", end_section=True)
    return table


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def nodes(ctx: Ctx, as_json: bool) -> None:
    """Show nodes and GPUs: Slurm's allocation, the probes' view, open reservations."""

    snap = ctx.broker.nodes()
    if as_json:
        emit_json(
            {
                "taken_at": snap.taken_at.isoformat(),
                "probe_ttl_s": snap.probe_ttl_s,
                "nodes": [_node_json(n) for n in snap.nodes],
            }
        )
        return
    ctx.console.print(nodes_table(snap))
