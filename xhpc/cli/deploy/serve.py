"""`xhpc serve MODEL`: admit, submit and follow a deployment until it answers."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import click
from pydantic import BaseModel
from rich.live import Live
from rich.table import Table

from xhpc.catalog import expand_request, resolve_model
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.cli.daemons import local_dry_run
from xhpc.cli.deploy.replica_configs import parse_replica_config
from xhpc.client.control import GONE, request_of
from xhpc.clock import utcnow
from xhpc.config import load_user_catalog
from xhpc.dashboard.spans import coming
from xhpc.engine_config import engine_config_of
from xhpc.errors import BrokerUnavailableError, ValidationError
from xhpc.models import (
    DeploymentView,
    EngineKind,
    ReplicaState,
    RestartPolicy,
    ScalingPolicy,
    ServeRequest,
)

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., object])


def build_request(**kw: object) -> ServeRequest:
    return build_request_of(ServeRequest, kw)


def build_request_of(cls: type[M], kw: dict[str, object]) -> M:
    """A request model from CLI options; a validation error names the flag."""
    return request_of(cls, kw, lambda field: "--" + field.replace("_", "-"))


def scaling_of(
    lo: int | None,
    hi: int | None,
    target: float | None,
    ttft: float | None,
    idle: float | None,
    down_window: float | None = None,
) -> ScalingPolicy | None:
    """The scaling policy of `--min`, `--max` and its knobs (None: none given); a knob without
    `--max` is an error."""
    if lo is None and hi is None:
        if any(k is not None for k in (target, ttft, idle, down_window)):
            raise ValidationError(
                "--target-inflight, --ttft, --idle and --down-window need --max (autoscaling)"
            )
        return None
    if hi is None:
        raise ValidationError("--min needs --max (autoscaling)")
    knobs: dict[str, object] = {"min_replicas": 1 if lo is None else lo, "max_replicas": hi,
                                "target_in_flight": target, "ttft_s": ttft}  # fmt: skip
    if idle is not None:
        knobs["idle_s"] = idle
    if down_window is not None:
        knobs["down_window_s"] = down_window
    return request_of(ScalingPolicy, knobs, lambda f: SCALING_FLAGS.get(f, "--min/--max"))


SCALING_FLAGS = {"min_replicas": "--min", "max_replicas": "--max", "target_in_flight":
                 "--target-inflight", "ttft_s": "--ttft", "idle_s": "--idle",
                 "down_window_s": "--down-window"}  # fmt: skip


def scaling_options(command: F) -> F:
    """The autoscaling knobs of `serve` and `scale` (each None when not given)."""
    for option in reversed(_SCALING_OPTIONS):
        command = option(command)
    return command


_SCALING_OPTIONS = (
    click.option(
        "--min",
        "min_replicas",
        default=None,
        type=int,
        help="Autoscale: the fewest replicas (0: asleep when idle). With --max.",
    ),
    click.option(
        "--max", "max_replicas", default=None, type=int, help="Autoscale: the most replicas."
    ),
    click.option(
        "--target-inflight",
        "target_in_flight",
        default=None,
        type=float,
        help="Autoscale: requests in flight per replica to aim for (default 4).",
    ),
    click.option(
        "--ttft", "ttft_s", default=None, type=float, help="Autoscale: p90 time to first token (s)."
    ),
    click.option(
        "--idle",
        "idle_s",
        default=None,
        type=float,
        help="Autoscale: seconds without a request before going down to --min (default 900).",
    ),
    click.option(
        "--down-window",
        "down_window_s",
        default=None,
        type=float,
        help="Autoscale: seconds of lower demand (and no change) before one replica fewer "
        "(default 300).",
    ),
)


def _given(option: str) -> bool:
    """Whether the command line set ``option`` (not its default)."""
    source = click.get_current_context().get_parameter_source(option)
    return source is not click.core.ParameterSource.DEFAULT


def progress_table(dep: DeploymentView, ids: set[str], now: datetime | None = None) -> Table:
    now = now or utcnow()
    table = Table(title=f"{dep.name} ({dep.engine.value}, {dep.gpus} GPU each)")
    for col in ("replica", "state", "job", "node", "gpus", "next", "detail"):
        table.add_column(col)
    for r in dep.replicas:
        if r.replica_id not in ids:
            continue
        out = r.outlook
        detail = r.reason or ""
        pending = out.pending_reason if out else None
        if pending and r.state is ReplicaState.QUEUED and pending not in detail:
            detail = f"{detail} (Slurm: {pending})" if detail else f"Slurm: {pending}"
        table.add_row(
            r.replica_id,
            r.state.value,
            r.job_id or "-",
            out.node_shown(r.node) if out else r.node or "-",
            ",".join(map(str, r.gpus)) or "-",
            coming(
                r.state.value,
                out.start_estimate if out else None,
                out.time_left_s if out else None,
                now,
            ),
            detail,
        )
    return table


def follow(ctx: Ctx, dep: DeploymentView, timeout_s: float, quiet: bool) -> DeploymentView:
    """Wait for READY and routed (``Client.wait_ready``), the replicas' progress shown live."""
    ids = {r.replica_id for r in dep.replicas if r.state not in GONE}
    if quiet:
        return ctx.broker.wait_ready(dep, timeout_s)
    with Live(
        progress_table(dep, ids),
        console=ctx.console,
        transient=False,
        auto_refresh=False,
        redirect_stderr=False,
    ) as live:
        return ctx.broker.wait_ready(
            dep, timeout_s, lambda now: live.update(progress_table(now, ids), refresh=True)
        )


@click.command()
@click.argument("model")
@click.option("--name", default=None, help="Deployment name (default: the model name).")
@click.option("--replicas", default=1, show_default=True, type=int)
@click.option(
    "--gpus",
    default=1,
    show_default=True,
    type=int,
    help="GPUs per replica (default: the catalog model's, else 1).",
)
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=int,
    help="Nodes each replica spans (--gpus on each): one job, one engine across them "
    "(vLLM; tensor parallel inside a node, pipeline across nodes unless --engine-arg says).",
)
@click.option("--engine", type=click.Choice([e.value for e in EngineKind]), default=None)
@click.option("--partition", default=None)
@click.option("--time", "time_limit", default=None, help="Slurm time limit, [D-]HH:MM:SS.")
@click.option("--nodelist", default=None, help="Place replicas only on these nodes.")
@click.option(
    "--let-slurm-place", is_flag=True, help="Skip xhpc's placement; Slurm picks the nodes."
)
@click.option("--engine-arg", "engine_args", multiple=True, help="Extra engine argument.")
@click.option(
    "--engine-config",
    "engine_config",
    default=None,
    metavar="JSON",
    help='How the engine serves the model, e.g. \'{"tool_call_parser": "hermes", '
    "\"enable_auto_tool_choice\": true}' (default: the catalog entry's; docs/engines.md).",
)
@click.option("--gpu-type", default=None, help="GPU type every replica needs (gres gpu:TYPE:K).")
@click.option(
    "--replica-config",
    "replica_configs",
    multiple=True,
    help="One replica's own target, once per replica in order: node=n1,gpus=2,gpu_type=a100,"
    'gpu_idx=0+1 (any subset of the keys) or JSON {"node": "n1", "gpu_idx": [0, 1]}. '
    "--replicas defaults to their count.",
)
@click.option(
    "--pilot",
    default=None,
    metavar="NODE",
    help="Run the replicas inside a pilot job on NODE: the one already there, or a new one "
    "holding --pilot-gpus GPUs (default: all of the node's).",
)
@click.option("--pilot-gpus", default=None, type=int, help="GPUs a new pilot job holds.")
@click.option(
    "--pd",
    default=None,
    metavar="xPyD",
    help="Prefill/decode disaggregation, e.g. 1P1D: each of --replicas units is one "
    "heterogeneous job with x prefill and y decode instances.",
)
@click.option("--prefill-gpus", default=None, type=int, help="GPUs per prefill instance.")
@click.option("--decode-gpus", default=None, type=int, help="GPUs per decode instance.")
@click.option(
    "--prefill-nodes", default=None, type=int, help="Nodes each prefill instance spans (--nodes)."
)
@click.option(
    "--decode-nodes", default=None, type=int, help="Nodes each decode instance spans (--nodes)."
)
@click.option("--prefill-arg", "prefill_args", multiple=True, help="Engine argument, prefill only.")
@click.option("--decode-arg", "decode_args", multiple=True, help="Engine argument, decode only.")
@click.option(
    "--restart",
    type=click.Choice([p.value for p in RestartPolicy]),
    default=None,
    help="When ended replicas are replaced (default: the site's, usually always); "
    "always and on-failure also hand over before each job's time limit.",
)
@click.option(
    "--for",
    "run_for",
    default=None,
    metavar="DURATION",
    help="End the deployment after this long ([D-]HH:MM:SS; default: until stopped). "
    "--time is each job's limit; the deployment outlives its jobs.",
)
@scaling_options
@click.option("--dry-run", is_flag=True, help="Print the sbatch script(s); submit nothing.")
@click.option("--detach", is_flag=True, help="Return once submitted.")
@click.option(
    "--timeout", "timeout_s", default=900.0, show_default=True, help="Seconds to wait for READY."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def serve(
    ctx: Ctx,
    model: str,
    name: str | None,
    replicas: int,
    gpus: int,
    nodes: int,
    engine: str | None,
    partition: str | None,
    time_limit: str | None,
    nodelist: str | None,
    let_slurm_place: bool,
    engine_args: tuple[str, ...],
    engine_config: str | None,
    gpu_type: str | None,
    replica_configs: tuple[str, ...],
    pilot: str | None,
    pilot_gpus: int | None,
    pd: str | None,
    prefill_gpus: int | None,
    decode_gpus: int | None,
    prefill_nodes: int | None,
    decode_nodes: int | None,
    prefill_args: tuple[str, ...],
    decode_args: tuple[str, ...],
    restart: str | None,
    run_for: str | None,
    min_replicas: int | None,
    max_replicas: int | None,
    target_in_flight: float | None,
    ttft_s: float | None,
    idle_s: float | None,
    down_window_s: float | None,
    dry_run: bool,
    detach: bool,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Serve MODEL (a catalog name or a local path) on the cluster."""
    replicas_given = _given("replicas")
    scaling = scaling_of(
        min_replicas, max_replicas, target_in_flight, ttft_s, idle_s, down_window_s
    )
    if scaling is not None and not replicas_given:
        replicas = max(1, scaling.min_replicas)
    elif (
        scaling is not None and not max(1, scaling.min_replicas) <= replicas <= scaling.max_replicas
    ):
        raise ValidationError(f"--replicas ({replicas}) must be within --min..--max")
    req = build_request(
        model=model,
        name=name,
        replicas=len(replica_configs) if replica_configs and not replicas_given else replicas,
        gpus=gpus,
        nodes=nodes,
        engine=engine,
        partition=partition,
        time=time_limit,
        nodelist=nodelist,
        engine_args=engine_args,
        engine_config=engine_config_of(engine_config, "--engine-config") if engine_config else None,
        let_slurm_place=let_slurm_place,
        gpu_type=gpu_type,
        replica_configs=tuple(parse_replica_config(rc) for rc in replica_configs),
        pilot=pilot,
        pilot_gpus=pilot_gpus,
        pd=pd,
        prefill_gpus=prefill_gpus,
        decode_gpus=decode_gpus,
        prefill_nodes=prefill_nodes,
        decode_nodes=decode_nodes,
        prefill_args=prefill_args,
        decode_args=decode_args,
        restart=restart,
        run_for=run_for,
        scaling=scaling,
    )
    # The catalog's defaults, and a member's own model as the request for its weights (the
    # broker never reads the member's catalog); then fail fast on an unknown or hostile name.
    req, warning = expand_request(req, ctx.config, load_user_catalog(), gpus_given=_given("gpus"))
    if warning:
        click.echo(f"warning: {warning}", err=True)
    resolve_model(req.model, ctx.config, req.name)
    if dry_run:
        try:
            scripts = ctx.broker.plan(req)
        except BrokerUnavailableError:
            if req.pilot is not None:
                raise
            scripts = local_dry_run(ctx.config, req)  # no broker: plan here
        if as_json:
            emit_json({"scripts": scripts})
        else:
            for rid, script in scripts.items():
                click.echo(f"# ---- {rid} ----")
                click.echo(script, nl=False)
        return
    dep = ctx.broker.serve(req)
    if not detach:
        try:
            dep = follow(ctx, dep, timeout_s, quiet=as_json)
        finally:
            if not as_json:
                click.echo()
    if as_json:
        emit_json(dep.model_dump(mode="json"))
        return
    proxy = f"http://{ctx.config.proxy.host}:{ctx.config.proxy.port}/v1"
    verb = "submitted" if detach else "ready"
    live = [r for r in dep.replicas if r.state not in GONE]
    click.echo(f"{dep.name}: {len(live)} replica(s) {verb}; endpoint {proxy} (model {dep.name!r})")
