"""`xhpc batch submit | status | results | cancel`: the OpenAI Batch API as Slurm job arrays
(docs/pipelines.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from xhpc.batch.spec import BatchView
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.cli.deploy.serve import build_request_of

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _show(view: BatchView) -> str:
    c = view.request_counts
    job = f", job {view.job_id}" if view.job_id else ""
    return (
        f"{view.id}: {view.status.value} ({c.completed} completed, {c.failed} failed of "
        f"{c.total}; {view.shards} shard(s){job})"
    )


@click.group()
def batch() -> None:
    """Batch inference: a JSONL file of requests run as a Slurm job array."""


@batch.command("submit")
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--model", required=True, help="Catalog name, a deployment you may use, or model directory."
)
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--engine", default=None)
@click.option("--shards", type=int, default=1, show_default=True, help="Array tasks.")
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs per task.")
@click.option("--partition", default=None)
@click.option("--qos", default=None, help="e.g. a low-priority, preemptible QOS.")
@click.option("--time", "time_", default="01:00:00", show_default=True, help="Per task.")
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option(
    "--online",
    is_flag=True,
    help="Send to the running replicas of deployment MODEL instead of a job array.",
)
@click.option("--wait", "wait_s", type=float, default=None, help="Wait this long for the end.")
@json_option
@pass_ctx
def submit(
    ctx: Ctx, input_file: Path, model: str, endpoint: str, engine: str | None, shards: int,
    gpus: int, partition: str | None, qos: str | None, time_: str, concurrency: int,
    online: bool, wait_s: float | None, as_json: bool,
) -> None:  # fmt: skip
    """Submit INPUT_FILE (OpenAI batch JSONL) for MODEL; prints the batch id."""
    from xhpc.batch.spec import BatchRequest

    input_id = ctx.broker.upload_batch_input(input_file)  # streamed, checked by the broker
    req = build_request_of(
        BatchRequest,
        {"model": model, "input_id": input_id, "endpoint": endpoint, "engine": engine,
         "shards": shards, "gpus": gpus, "partition": partition, "qos": qos, "time": time_,
         "concurrency": concurrency, "online": online},
    )  # fmt: skip
    view = ctx.broker.create_batch(req)
    if wait_s is not None:
        view = ctx.broker.wait_batch(view.id, wait_s)
    if as_json:
        emit_json(view.model_dump(mode="json"))
        return
    click.echo(_show(view))


@batch.command("status")
@click.argument("batch_id", required=False)
@json_option
@pass_ctx
def status(ctx: Ctx, batch_id: str | None, as_json: bool) -> None:
    """One batch's status and counts, or every batch of yours."""
    views = [ctx.broker.batch(batch_id)] if batch_id else ctx.broker.batches()
    if as_json:
        emit_json([v.model_dump(mode="json") for v in views] if not batch_id else
                  views[0].model_dump(mode="json"))  # fmt: skip
        return
    for view in views:
        click.echo(_show(view))
        for err in view.errors:
            click.echo(f"  error: {err}")


@batch.command("results")
@click.argument("batch_id")
@click.option("--errors", is_flag=True, help="The error file instead of the output file.")
@pass_ctx
def results(ctx: Ctx, batch_id: str, errors: bool) -> None:
    """Print a finished batch's output (or error) file: one JSON line per request."""
    sys.stdout.write(ctx.broker.batch_output(batch_id, errors))


@batch.command("cancel")
@click.argument("batch_id")
@json_option
@pass_ctx
def cancel(ctx: Ctx, batch_id: str, as_json: bool) -> None:
    """Cancel a batch: its array is cancelled and what was answered is kept."""
    view = ctx.broker.cancel_batch(batch_id)
    if as_json:
        emit_json(view.model_dump(mode="json"))
        return
    click.echo(_show(view))
