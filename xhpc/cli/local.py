"""`xhpc run-server MODEL`: serve a model inside this job's allocation, no broker
(xhpc.agent.local), until SIGTERM or SIGINT (the job's end, or Ctrl-C)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import click

from xhpc.cli.context import Ctx, pass_ctx
from xhpc.models import EngineKind


def _write_private(path: Path, text: str) -> None:
    """``text`` in a new owner-only file (an old one is replaced, never written through)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


@click.command("run-server")
@click.argument("model")
@click.option("--gpus", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--engine", type=click.Choice([e.value for e in EngineKind]), default=None)
@click.option("--name", default=None, help="The name it serves the model under.")
@click.option("--host", default="127.0.0.1", show_default=True, help="0.0.0.0: every address.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Default: a free one.")
@click.option("--engine-arg", "engine_args", multiple=True, help="Extra engine argument.")
@click.option(
    "--engine-config",
    "engine_config",
    default=None,
    metavar="JSON",
    help="How the engine serves the model, as `xhpc serve --engine-config` takes it (default: "
    "the catalog entry's; docs/engines.md).",
)
@click.option("--timeout", "timeout_s", type=float, default=None, help="Startup deadline (s).")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write {base_url, model, gpus, key_file} here (JSON) once the engine answers.",
)
@click.option(
    "--key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the server's API key here (owner-only; default: beside the ready file).",
)
@pass_ctx
def run_server(
    ctx: Ctx,
    model: str,
    gpus: int,
    engine: str | None,
    name: str | None,
    host: str,
    port: int | None,
    engine_args: tuple[str, ...],
    engine_config: str | None,
    timeout_s: float | None,
    ready_file: Path | None,
    key_file: Path | None,
) -> None:
    """Serve MODEL on this job's GPUs and this node, until the job ends (no broker)."""
    from xhpc.agent.local import local_engine
    from xhpc.engine_config import engine_config_of

    typed = engine_config_of(engine_config, "--engine-config") if engine_config else None
    server = local_engine(
        model,
        ctx.config,
        gpus=gpus,
        engine=engine,
        engine_args=engine_args,
        name=name,
        host=host,
        port=port,
        timeout_s=timeout_s,
        engine_config=typed,
    )
    if key_file is None and ready_file is not None:
        key_file = ready_file.with_name(ready_file.name + ".key")

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        try:
            base_url = f"{server.url}/v1"
            if key_file is not None:
                _write_private(key_file, server.secret + "\n")
            if ready_file is not None:
                facts = {
                    "base_url": base_url,
                    "model": server.served_model,
                    "gpus": list(server.gpus),
                    "key_file": str(key_file),
                }
                _write_private(ready_file, json.dumps(facts) + "\n")
            shown = ",".join(map(str, server.gpus)) or "none"
            click.echo(f"serving {server.served_model} at {base_url} (GPUs {shown})", err=True)
            ended = asyncio.create_task(server.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({ended, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ended.done():
                click.echo(
                    f"xhpc: error: the engine exited with code {ended.result()}; "
                    f"engine log: {server.log_tail()}",
                    err=True,
                )
                return 1
            ended.cancel()
            return 0
        finally:
            await server.stop()
            for path in (ready_file, key_file):
                if path is not None:
                    path.unlink(missing_ok=True)

    raise SystemExit(asyncio.run(run()))
