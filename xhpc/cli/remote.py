"""Remote use from a laptop: `xhpc --remote USER@HOST COMMAND ...` runs COMMAND on the login
node over SSH (xhpc/cli/main.py sends it there before any local parsing), and `xhpc tunnel`
forwards a local port to the lab's proxy. The SSH code is xhpc/remote/; see
docs/decisions/0022-remote-use-over-ssh.md."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

from xhpc.cli.meta import DEBUG_META, REMOTE_META, SITE_META
from xhpc.config import remote_xhpc_env
from xhpc.errors import RemoteError, ValidationError
from xhpc.gateway_settings import gateway_origin
from xhpc.remote.argv import (
    DEFAULT_REMOTE_XHPC,
    RemoteOptions,
    RemoteSplit,
    parse_destination,
    remote_command,
)

if TYPE_CHECKING:
    from xhpc.remote.session import SSHClient, SshSettings

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def _remote_xhpc(options: RemoteOptions) -> str:
    return options.remote_xhpc or remote_xhpc_env() or DEFAULT_REMOTE_XHPC


def _settings(options: RemoteOptions) -> SshSettings:
    from xhpc.remote.session import SshSettings

    return SshSettings(
        destination=parse_destination(options.destination),
        identities=tuple(Path(p) for p in options.identities),
        known_hosts=Path(options.known_hosts or DEFAULT_KNOWN_HOSTS),
        accept_new_host_key=options.accept_new_host_key,
    )


def _connect(options: RemoteOptions) -> SSHClient:
    from xhpc.remote import session

    return session.connect(_settings(options))


def quiet_ssh_logs(debug: bool) -> None:
    """paramiko logs what xhpc's errors already say (a channel refused, a lost connection):
    only with --debug."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if not debug:
        logging.getLogger("paramiko").setLevel(logging.CRITICAL)


def run_remote(split: RemoteSplit, *, debug: bool = False) -> int:
    """Run the forwarded argv on the login node; its output here as it comes; its exit code."""
    from xhpc.remote import session

    quiet_ssh_logs(debug)
    command = remote_command(_remote_xhpc(split.options), split.forwarded)
    settings = _settings(split.options)  # bad input fails before any connection
    client = session.connect(settings)
    try:
        return session.run(client, command, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    finally:
        client.close()


def _parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValidationError(f"--to {text!r}: expected HOST:PORT")
    return host, int(port)


def _proxy_of_login_node(
    client: SSHClient, options: RemoteOptions, site: Path | None
) -> tuple[list[tuple[str, int]], bool]:
    """The gateways' addresses as the login node's config says (`xhpc config show` run there:
    ``[proxy] gateways``, else its own host and port), and whether they speak HTTPS."""
    from xhpc.remote import session

    args = ["--site", str(site)] if site else []
    command = remote_command(_remote_xhpc(options), [*args, "config", "show"])
    done = session.capture(client, command)
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    why = lines[-1] if lines else f"exit {done.code}"
    try:
        if done.code != 0:
            raise ValueError(why)
        proxy = json.loads(done.stdout)["proxy"]
        host, port = str(proxy["host"]), int(proxy["port"])
        tls = bool(proxy.get("tls_cert_file"))
        gateways = [gateway_origin(str(url)) for url in proxy.get("gateways") or ()]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise RemoteError(
            f"cannot read the proxy's address from the login node's config: {why}",
            hint="give it with --to HOST:PORT",
        ) from err
    if port == 0:
        raise RemoteError(
            "the login node's config lets the proxy take any free port (proxy.port = 0)",
            hint="give it with --to HOST:PORT",
        )
    if gateways:
        return [(h, p) for _, h, p in gateways], gateways[0][0] == "https"
    return [(_ANY_ADDRESS.get(host, host), port)], tls


@click.command()
@click.option(
    "--port",
    "local_port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Local port on 127.0.0.1 (default: the proxy's own; 0: any free port).",
)
@click.option(
    "--to",
    "to",
    default=None,
    metavar="HOST:PORT",
    help="The proxy as the login node reaches it; several, comma-separated, are tried in turn"
    " (default: [proxy] gateways of the login node's config, else its host and port).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the URL and ports as JSON.")
@click.pass_context
def tunnel(ctx: click.Context, local_port: int | None, to: str | None, as_json: bool) -> None:
    """Forward a local port to the lab's proxy over SSH (with --remote USER@HOST).

    Prints the base URL for the openai SDK (http://127.0.0.1:PORT/v1), then forwards until
    Ctrl-C. Only this machine's loopback listens."""
    from xhpc.remote.tunnel import Tunnel

    quiet_ssh_logs(ctx.meta.get(DEBUG_META, False))
    options = ctx.meta.get(REMOTE_META)
    if not isinstance(options, RemoteOptions):
        raise ValidationError("xhpc tunnel needs --remote USER@HOST (the login node)")
    targets = [_parse_target(t) for t in to.split(",")] if to is not None else None
    client = _connect(options)
    try:
        tls = False
        if targets is None:
            targets, tls = _proxy_of_login_node(client, options, ctx.meta.get(SITE_META))
        transport = client.get_transport()
        if transport is None:
            raise RemoteError("the SSH connection closed")
        forward = Tunnel(
            transport,
            targets,
            targets[0][1] if local_port is None else local_port,
            on_error=lambda line: click.echo(f"xhpc tunnel: {line}", err=True),
        )
        forward.check()
        url = f"{'https' if tls else 'http'}://127.0.0.1:{forward.port}/v1"
        target = forward.target
        if as_json:
            info = {"url": url, "local_port": forward.port, "to": f"{target[0]}:{target[1]}"}
            click.echo(json.dumps(info))
        else:
            click.echo(url)
        click.echo(
            f"forwarding 127.0.0.1:{forward.port} to {target[0]}:{target[1]} on"
            f" {options.destination}; Ctrl-C to stop",
            err=True,
        )
        sys.stdout.flush()
        # Ctrl-C or SIGTERM: the tunnel's ordinary end. Handlers of its own, since a process
        # started in the background by a shell inherits SIGINT ignored.
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        forward.serve(stop)
    finally:
        client.close()
