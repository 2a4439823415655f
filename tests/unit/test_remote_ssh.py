"""`xhpc --remote` and `xhpc tunnel` against a real OpenSSH server on loopback (tests/sshd.py):
a remote command's output and exit code are the login node's own, host keys are checked,
arguments reach the remote xhpc as the words they were, and a tunnel carries the openai SDK to
a stand-in proxy."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import readable_site_config
from tests.sshd import Sshd, interrupt_tunnel, needs_sshd, running_sshd

pytestmark = [needs_sshd, pytest.mark.ssh]

# Prints the argv and the environment variables it was given, as JSON: stands in for xhpc.
ECHO = (
    "/usr/bin/python3 -c"
    " 'import json, os, sys; print(json.dumps([sys.argv[1:], sorted(os.environ)]))'"
)


@pytest.fixture(scope="module")
def sshd() -> Iterator[Sshd]:
    with running_sshd() as server:
        yield server


def laptop(sshd: Sshd, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        args, env=sshd.laptop_env(**env), capture_output=True, timeout=60, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("--version",), 0),
        (("--site", "@SITE", "config", "show"), 0),
        (("--site", "@SITE", "config", "show", "--no-such-flag"), 2),
        (("--site", "/no/such/site.toml", "config", "show"), 2),
    ],
    ids=["version", "config-show", "usage-error", "config-error"],
)
def test_a_remote_command_prints_and_exits_as_on_the_login_node(
    sshd: Sshd, args: tuple[str, ...], code: int
) -> None:
    # The login node's user reads a site file of its own, not this checkout's (which may sit
    # where only root can read).
    args = tuple(str(readable_site_config()) if a == "@SITE" else a for a in args)
    here = sshd.login_node_run(*args)
    there = laptop(sshd, *sshd.remote_argv(*args))
    assert (there.stdout, there.stderr, there.returncode) == (
        here.stdout,
        here.stderr,
        here.returncode,
    )
    assert here.returncode == code and (here.stdout if code == 0 else here.stderr)


def test_arguments_arrive_as_the_words_they_were_and_no_key_travels(sshd: Sshd) -> None:
    canary = sshd.dir / "canary"
    hostile = [
        "a b",
        "it's",
        'say "hi"',
        f"x; touch {canary}",
        f"$(touch {canary})",
        f"`touch {canary}`",
        "*",
        "new\nline",
        "",
        "--json",
        "back\\slash | cat && true",
    ]
    argv = sshd.remote_argv(*hostile)
    argv[argv.index("--remote-xhpc") + 1] = ECHO
    done = laptop(sshd, *argv, OPENAI_API_KEY="sk-secret-laptop", XHPC_REMOTE_XHPC="unused")
    assert done.returncode == 0, done.stderr
    got_argv, got_env = json.loads(done.stdout)
    assert got_argv == hostile
    assert not canary.exists()
    assert "OPENAI_API_KEY" not in got_env and not [k for k in got_env if k.startswith("XHPC_")]


def test_the_remote_xhpc_comes_from_the_environment_when_no_option_names_it(sshd: Sshd) -> None:
    argv = sshd.remote_argv("one", "two")
    i = argv.index("--remote-xhpc")
    del argv[i : i + 2]
    done = laptop(sshd, *argv, XHPC_REMOTE_XHPC=ECHO)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0] == ["one", "two"]


def test_an_unknown_host_key_is_refused_and_nothing_runs(sshd: Sshd, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    done = laptop(sshd, *sshd.remote_argv("--version", known_hosts=empty))
    assert done.returncode == 255 and done.stdout == b""
    line = done.stderr.decode()
    assert line.count("\n") == 1 and line.startswith("error: ")
    assert "is not in" in line and "refusing" in line and "SHA256:" in line
    assert empty.read_text() == ""


def test_a_changed_host_key_is_refused_even_with_accept_new(sshd: Sshd, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, blob, *_ = other.with_suffix(".pub").read_text().split()
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")
    argv = sshd.remote_argv("--version", known_hosts=wrong)
    done = laptop(sshd, *argv[:1], "--accept-new-host-key", *argv[1:])
    assert done.returncode == 255 and done.stdout == b""
    assert "does not match" in done.stderr.decode() and done.stderr.decode().count("\n") == 1


def test_accept_new_host_key_adds_it_once(sshd: Sshd, tmp_path: Path) -> None:
    known = tmp_path / "ssh" / "known_hosts"
    argv = sshd.remote_argv("--version", known_hosts=known)
    first = laptop(sshd, *argv[:1], "--accept-new-host-key", *argv[1:])
    assert first.returncode == 0, first.stderr
    assert b"added [127.0.0.1]:" in first.stderr
    assert known.read_text().split() == [f"[127.0.0.1]:{sshd.port}", *sshd.host_public.split()]
    again = laptop(sshd, *argv)  # no flag: the key is known now
    assert (again.returncode, again.stdout) == (0, first.stdout)


def test_a_wrong_key_fails_with_one_line(sshd: Sshd, tmp_path: Path) -> None:
    stranger = tmp_path / "id_stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    argv = sshd.remote_argv("--version")
    argv[argv.index("--identity") + 1] = str(stranger)
    done = laptop(sshd, *argv)
    assert done.returncode == 255 and done.stdout == b""
    assert done.stderr.startswith(b"error: ") and b"authentication failed" in done.stderr


class _StandIn(BaseHTTPRequestHandler):
    """The lab's proxy, as far as the openai SDK's model list goes."""

    def do_GET(self) -> None:
        body = json.dumps(
            {"object": "list", "data": [{"id": "tiny-llama", "object": "model", "created": 0,
                                         "owned_by": "xhpc", "path": self.path}]}
        ).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stand_in_proxy() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_tunnel_carries_the_openai_sdk_to_the_proxy_the_login_node_config_names(
    sshd: Sshd, stand_in_proxy: int
) -> None:
    import openai

    site = sshd.dir / "site.toml"
    site.write_text(f'[proxy]\nhost = "0.0.0.0"\nport = {stand_in_proxy}\n')
    site.chmod(0o644)
    argv = sshd.remote_argv("--site", str(site), "tunnel", "--port", "0", "--json")
    # Started as a shell's background job is: SIGINT ignored, inherited; Ctrl-C still ends it.
    proc = subprocess.Popen(
        argv,
        env=sshd.laptop_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline() or b"null")
        assert info is not None, proc.stderr.read() if proc.stderr else ""
        assert info["to"] == f"127.0.0.1:{stand_in_proxy}"
        assert info["url"] == f"http://127.0.0.1:{info['local_port']}/v1"
        assert info["local_port"] != stand_in_proxy
        client = openai.OpenAI(base_url=info["url"], api_key="unused", max_retries=0, timeout=20)
        models = client.models.list()
        assert [m.id for m in models.data] == ["tiny-llama"]
        assert models.data[0].model_extra == {"path": "/v1/models"}
    finally:
        code = interrupt_tunnel(proc)
    assert code == 0


def test_a_tunnel_goes_to_the_next_gateway_when_the_first_is_down(
    sshd: Sshd, stand_in_proxy: int
) -> None:
    """Two login nodes' gateways (``[proxy] gateways``): the first does not answer, so the
    tunnel forwards to the second, and the openai SDK gets its answer through it."""
    import openai

    from tests.conftest import free_port

    dead = free_port()
    site = sshd.dir / "site-two.toml"
    site.write_text(
        f'[proxy]\ngateways = ["http://127.0.0.1:{dead}", "http://127.0.0.1:{stand_in_proxy}"]\n'
    )
    site.chmod(0o644)
    argv = sshd.remote_argv("--site", str(site), "tunnel", "--port", "0", "--json")
    proc = subprocess.Popen(
        argv, env=sshd.laptop_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline() or b"null")
        assert info is not None, proc.stderr.read() if proc.stderr else ""
        assert info["to"] == f"127.0.0.1:{stand_in_proxy}"
        client = openai.OpenAI(base_url=info["url"], api_key="unused", max_retries=0, timeout=20)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    finally:
        code = interrupt_tunnel(proc)
    assert code == 0


def test_a_tunnel_to_nothing_fails_at_once_with_one_line(sshd: Sshd) -> None:
    from tests.conftest import free_port

    argv = sshd.remote_argv("tunnel", "--port", "0", "--to", f"127.0.0.1:{free_port()}")
    done = laptop(sshd, *argv)
    assert done.returncode == 255 and done.stdout == b""
    assert done.stderr.startswith(b"error: the login node cannot reach 127.0.0.1:")
    assert done.stderr.count(b"\n") == 1
