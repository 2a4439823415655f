"""A real OpenSSH server of the test's own on 127.0.0.1: its own host key, config, authorized
keys and pid file in a temp directory, a client key and a known_hosts file for it, and a Unix
user of its own to log in as (made with useradd and removed after; root where that cannot be
done). That user runs this checkout's xhpc through a wrapper script it can execute."""

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
from collections.abc import Iterator
from contextlib import contextmanager
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
        return f"{self.user}@127.0.0.1:{self.port}"

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


def _wrapper(base: Path, uid: int) -> str:
    """An executable the user runs as `xhpc` (this checkout's .venv may sit where only root
    can reach: then a readable copy run with the system's Python, as tests/conftest.py's
    xhpc_as makes)."""
    if uid == 0:
        return XHPC
    argv, env = xhpc_as(uid, portable=True)
    script = base / "xhpc"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    script.write_text(f'#!/bin/sh\n{exports}exec {shlex.join(argv)} "$@"\n')
    script.chmod(0o755)
    return str(script)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"sshd did not listen on {port}: {log.read_text()[-2000:]}")


@contextmanager
def running_sshd() -> Iterator[Sshd]:
    base = Path(tempfile.mkdtemp(prefix="xhpc-sshd-", dir="/tmp"))
    base.chmod(0o755)
    user, uid, home = _make_user(base)
    proc: subprocess.Popen[bytes] | None = None
    try:
        host_public = _keygen(base / "host_key")
        client_public = _keygen(base / "client_key")
        (base / "authorized_keys").write_text(client_public + "\n")
        port = free_port()
        config = base / "sshd_config"
        config.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base / 'host_key'}\n"
            f"PidFile {base / 'sshd.pid'}\nAuthorizedKeysFile {base / 'authorized_keys'}\n"
            "UsePAM no\nStrictModes no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\n"
            f"AllowUsers {user}\nPrintMotd no\nPrintLastLog no\nLogLevel VERBOSE\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        known_hosts = base / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_public}\n")
        (base / "laptop-home").mkdir()
        log = base / "sshd.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(config)], stdout=out, stderr=out
            )
        _wait_listening(port, proc, log)
        yield Sshd(
            port=port,
            user=user,
            uid=uid,
            home=home,
            dir=base,
            client_key=base / "client_key",
            known_hosts=known_hosts,
            host_public=host_public,
            remote_xhpc=_wrapper(base, uid),
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
