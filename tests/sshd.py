"""A real OpenSSH server of the test's own on 127.0.0.1: its own host key, config, authorized
keys and pid file in a temp directory, a client key and a known_hosts file for it, and a Unix
user of its own to log in as (made with useradd and removed after; root where that cannot be
done). That user runs this checkout's xhpc through a wrapper script it can execute.

``login_namespace`` makes a network namespace of the test's own on a bridge (the dev
cluster's: a login node beside the compute nodes); ``running_sshd(netns=..., address=...)``
runs the sshd there, under ``ip netns exec``, on port 22 of that address."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import as_uid, free_port, xhpc_as

SSHD = Path("/usr/sbin/sshd")
XHPC = str(Path(sys.executable).parent / "xhpc")

needs_sshd = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or os.geteuid() != 0
    or not SSHD.is_file()
    or shutil.which("ssh-keygen") is None,
    reason="needs Linux, root and OpenSSH's sshd and ssh-keygen (Debian: openssh-server)",
)


@dataclass
class Sshd:
    host: str  # the address sshd listens on
    port: int
    user: str
    uid: int
    home: Path
    dir: Path
    client_key: Path
    known_hosts: Path
    host_public: str  # "ssh-ed25519 AAAA..."
    remote_xhpc: str  # the login node's xhpc for this user (a wrapper script)

    @property
    def destination(self) -> str:
        return f"{self.user}@{_host_port(self.host, self.port)}"

    def remote_argv(self, *args: str, known_hosts: Path | None = None) -> list[str]:
        """`xhpc --remote ...` on this machine (the laptop), then ``args``."""
        return [
            XHPC,
            "--remote", self.destination,
            "--identity", str(self.client_key),
            "--known-hosts", str(known_hosts or self.known_hosts),
            "--remote-xhpc", self.remote_xhpc,
            *args,
        ]  # fmt: skip

    def laptop_env(self, **extra: str) -> dict[str, str]:
        """This machine's environment for the laptop side: no agent, no XHPC_* of the caller."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("XHPC_", "SSH_")) and k != "PYTHONPATH"
        }
        env.update(HOME=str(self.dir / "laptop-home"), **extra)
        return env

    def login_node_run(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """``xhpc ARGS`` run directly on the login node, as the user, in the environment sshd
        gives that user's commands."""
        prefix = [] if self.uid == 0 else as_uid(self.uid)
        env = {"HOME": str(self.home), "USER": self.user, "LOGNAME": self.user}
        env["PATH"] = "/usr/local/bin:/usr/bin:/bin:/usr/games"
        return subprocess.run(
            [*prefix, self.remote_xhpc, *args], env=env, capture_output=True, timeout=60
        )


def interrupt_tunnel(proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C to an `xhpc tunnel`; its exit code. One that outlives it is killed (nothing
    left behind) and fails the test."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the tunnel did not end on SIGINT within 20 s") from None


def _host_port(host: str, port: int) -> str:
    return host if port == 22 else f"{host}:{port}"


def _known_host(host: str, port: int) -> str:
    """The host's name in known_hosts, as OpenSSH writes it."""
    return host if port == 22 else f"[{host}]:{port}"


def _keygen(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "xhpc-test", "-f", str(path)],
        check=True,
        capture_output=True,
    )
    kind, blob, *_ = path.with_suffix(".pub").read_text().split()
    return f"{kind} {blob}"


def _make_user(base: Path) -> tuple[str, int, Path]:
    """A fresh user with a home under ``base``; root when useradd is missing or fails."""
    name = f"xhpcssh{os.getpid() % 100000}"
    home = base / "home"
    useradd = shutil.which("useradd")
    # "*": no password, but not a locked account (sshd without PAM refuses those).
    if (
        useradd
        and not subprocess.run(
            [useradd, "-M", "-d", str(home), "-s", "/bin/sh", "-p", "*", "-U", name],
            capture_output=True,
        ).returncode
    ):
        uid = pwd.getpwnam(name).pw_uid
        home.mkdir(mode=0o700)
        os.chown(home, uid, uid)
        return name, uid, home
    return "root", 0, Path(pwd.getpwuid(0).pw_dir)


def _wrapper(base: Path, uid: int, login_env: Mapping[str, str]) -> str:
    """An executable the user runs as `xhpc` (root: this checkout's; another user: the installed
    wheel, as tests/conftest.py's xhpc_as gives it, never the checkout). ``login_env`` is what
    the login node's setup exports for xhpc (a site's
    module file: XHPC_SITE_CONFIG, XHPC_STATE_DIR, ...)."""
    if uid == 0 and not login_env:
        return XHPC
    argv, env = ([XHPC], {}) if uid == 0 else xhpc_as(uid)
    script = base / "xhpc"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in {**env, **login_env}.items())
    script.write_text(f'#!/bin/sh\n{exports}exec {shlex.join(argv)} "$@"\n')
    script.chmod(0o755)
    return str(script)


def _wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"sshd did not listen on {host}:{port}: {log.read_text()[-2000:]}")


@contextmanager
def running_sshd(
    *,
    netns: str | None = None,
    address: str = "127.0.0.1",
    login_env: Mapping[str, str] | None = None,
) -> Iterator[Sshd]:
    """An sshd on ``address`` (in the network namespace ``netns``: port 22, as a login node's;
    on this machine's loopback: any free port). ``login_env``: exported by the user's xhpc."""
    base = Path(tempfile.mkdtemp(prefix="xhpc-sshd-", dir="/tmp"))
    base.chmod(0o755)
    user, uid, home = _make_user(base)
    proc: subprocess.Popen[bytes] | None = None
    try:
        host_public = _keygen(base / "host_key")
        client_public = _keygen(base / "client_key")
        (base / "authorized_keys").write_text(client_public + "\n")
        port = 22 if netns else free_port()
        config = base / "sshd_config"
        config.write_text(
            f"Port {port}\nListenAddress {address}\nHostKey {base / 'host_key'}\n"
            f"PidFile {base / 'sshd.pid'}\nAuthorizedKeysFile {base / 'authorized_keys'}\n"
            "UsePAM no\nStrictModes no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\n"
            f"AllowUsers {user}\nPrintMotd no\nPrintLastLog no\nLogLevel VERBOSE\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        known_hosts = base / "known_hosts"
        known_hosts.write_text(f"{_known_host(address, port)} {host_public}\n")
        (base / "laptop-home").mkdir()
        log = base / "sshd.log"
        with log.open("wb") as out:
            # `ip netns exec` execs sshd: proc.pid is sshd's own.
            enter = ["ip", "netns", "exec", netns] if netns else []
            proc = subprocess.Popen(
                [*enter, str(SSHD), "-D", "-e", "-f", str(config)], stdout=out, stderr=out
            )
        _wait_listening(address, port, proc, log)
        yield Sshd(
            host=address,
            port=port,
            user=user,
            uid=uid,
            home=home,
            dir=base,
            client_key=base / "client_key",
            known_hosts=known_hosts,
            host_public=host_public,
            remote_xhpc=_wrapper(base, uid, login_env or {}),
        )
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # our own sshd, by its pid
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        if uid != 0:
            subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@dataclass(frozen=True)
class LoginNamespace:
    name: str  # the network namespace, made by login_namespace and removed by it
    address: str  # its address on the bridge


def _login_addresses() -> set[str]:
    """IPv4 addresses of the login namespaces of other test sessions (the compute nodes'
    addresses, 10.77.0.(10+K) with K at most 200, are below the range asked for)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    used: set[str] = set()
    for name in (line.split()[0] for line in listed.splitlines() if line.split()):
        if not name.startswith("xhpc-login"):
            continue
        argv = ["ip", "-n", name, "-o", "-4", "addr", "show"]
        for line in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines():
            words = line.split()
            if "inet" in words:
                used.add(words[words.index("inet") + 1].split("/")[0])
    return used


def _stop_namespace_processes(name: str) -> None:
    """What still runs inside the test's own namespace (sshd's sessions): TERM, then KILL."""
    deadline = time.monotonic() + 10
    sig = signal.SIGTERM
    while True:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig, deadline = signal.SIGKILL, time.monotonic() + 5
        time.sleep(0.1)


@contextmanager
def login_namespace(bridge: str, prefix: str, last_octets: range) -> Iterator[LoginNamespace]:
    """A network namespace of this test's own (``xhpc-login<pid>``) joined to ``bridge`` by a
    veth pair, at the first address ``prefix.N`` (N in ``last_octets``) that no other login
    namespace holds, /24. At the end its processes are stopped and the veth and the namespace
    it made are deleted, by their names."""
    tag = os.getpid() % 100000
    name, veth = f"xhpc-login{tag}", f"xhpcl{tag}"  # an interface name has at most 15 bytes
    if Path("/run/netns", name).exists():
        raise AssertionError(f"a namespace {name} already exists (not this test's)")
    used = _login_addresses()
    free = [f"{prefix}.{n}" for n in last_octets if f"{prefix}.{n}" not in used]
    if not free:
        raise AssertionError(
            f"no free address in {prefix}.{last_octets.start}-{last_octets.stop - 1}"
        )
    address = free[0]
    made_ns = made_veth = False

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", name)
        made_ns = True
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        made_veth = True
        ip("link", "set", veth, "master", bridge)
        ip("link", "set", veth, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        yield LoginNamespace(name=name, address=address)
    finally:
        if made_ns:
            _stop_namespace_processes(name)
        if made_veth:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        if made_ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
