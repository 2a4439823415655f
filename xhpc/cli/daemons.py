"""`xhpc broker | proxy | probe`: the commands that run a daemon; and `serve --dry-run` locally.

The only CLI module that uses the orchestration packages (xhpc.broker, xhpc.proxy, xhpc.probe),
and only inside function bodies (asyncio too): every other command is a client of the broker's
control API, so `xhpc --help` or `xhpc ps` never import aiohttp, SQL, numpy or the planner. The
import-linter contract "The CLI is a client of the broker" (pyproject.toml) lists these imports.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from xhpc.catalog import resolve_model
from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.cli.probe import node_name, print_report
from xhpc.errors import AdmissionError
from xhpc.models import ServeRequest
from xhpc.paths import PROBE_TOKEN_FILE, broker_file_path, control_socket_path
from xhpc.settings import ProbeSettings, XhpcConfig


@click.command()
@click.option(
    "--standby",
    is_flag=True,
    help="Wait while another broker leads on this state (its lease in the database), and "
    "take over when it stops or its lease runs out.",
)
@pass_ctx
def broker(ctx: Ctx, standby: bool) -> None:
    """Run the broker (control API, agent API, reconcile loop) in the foreground."""
    import asyncio

    from xhpc.broker.server import run_broker

    logging.getLogger().setLevel(logging.INFO)
    asyncio.run(run_broker(ctx.config, standby=standby))


@click.command()
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the URL the proxy listens on here once it does (useful with port 0).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes sharing the port (default: proxy.workers); 1: a single process.",
)
@pass_ctx
def proxy(ctx: Ctx, ready_file: Path | None, workers: int | None) -> None:
    """Run the OpenAI-compatible proxy in the foreground.

    With several workers, SIGHUP reloads them (fresh workers read the config again, then the
    old ones finish their requests) and SIGTERM stops them once their requests are done.
    """
    import asyncio

    logging.getLogger().setLevel(logging.INFO)
    socket_path = control_socket_path(ctx.config)
    count = workers if workers is not None else ctx.config.proxy.workers
    if count == 1:
        from xhpc.proxy.process.server import run_proxy

        asyncio.run(run_proxy(ctx.config, socket_path, ready_file=ready_file))
        return
    from xhpc.proxy.process.supervisor import run_supervisor
    from xhpc.proxy.process.worker import WorkerCommand

    root = click.get_current_context().find_root().params
    command = WorkerCommand(socket_path, site=root.get("site"), debug=bool(root.get("debug")))
    asyncio.run(run_supervisor(ctx.config.proxy, count, command, ready_file=ready_file))


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
    name = node_name(node)
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
    import asyncio

    from xhpc.probe.backends import open_backend
    from xhpc.probe.runner import run_probe
    from xhpc.probe.sample import HostSampler, sample

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
                print_report(ctx.console, report)
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


def local_dry_run(config: XhpcConfig, req: ServeRequest) -> dict[str, str]:
    """`serve --dry-run` with no broker: admit and render the scripts here (replica indexes
    start at 0), from a fresh `sinfo`."""
    import asyncio

    from xhpc.broker.plan.planner import admission_problems, choose_engine, plan_deployment
    from xhpc.slurm.client import CliSlurmClient

    model = resolve_model(req.model, config, req.name)
    engine = choose_engine(req, model, config)
    nodes = asyncio.run(CliSlurmClient(config.slurm).nodes())
    if req.pd is not None:  # whole units, each one heterogeneous job (Slurm places them)
        from xhpc.broker.plan.pd_planner import pd_admission_problems, plan_units

        problems, _ = pd_admission_problems(req, nodes, config, engine, weights=str(model.path))
        if problems:
            raise AdmissionError(problems)
        units = plan_units(
            req, model, config, start_index=0, agent_python=sys.executable, broker_id="default"
        )
        return units.scripts()
    problems = admission_problems(req, nodes, config, engine)
    if problems:
        raise AdmissionError(problems)
    plan = plan_deployment(req, model, config, start_index=0, agent_python=sys.executable)
    return plan.scripts()
