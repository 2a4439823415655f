"""A member's broker shares its control socket with a group (the lab gateway's user): members
of the group connect, other users do not; a group that does not exist, or that the broker's
user is not in, is a one-line error before anything starts. Real sockets, real Unix users."""

from __future__ import annotations

import grp
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_other_users
from xhpc.broker.server import _share, socket_group_id
from xhpc.errors import XhpcError
from xhpc.settings import BrokerConfig, XhpcConfig

PYTHON = "/usr/bin/python3"
GROUP = "users"  # a group every Debian system has
IN_GROUP_UID, OTHER_UID = 4251, 4252

pytestmark = [needs_other_users, pytest.mark.security]

CONNECT = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('in')"


def connects(uid: int, groups: list[int], sock: Path) -> bool:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}"]
    argv += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    done = subprocess.run(
        [*argv, PYTHON, "-c", CONNECT, str(sock)], capture_output=True, text=True, timeout=30
    )
    return done.returncode == 0 and done.stdout.strip() == "in"


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every uid may traverse (pytest's own tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="xhpc-sockgroup-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_socket_is_shared_with_its_group_only(shared_tmp: Path) -> None:
    gid = grp.getgrnam(GROUP).gr_gid
    state = shared_tmp / "state"
    state.mkdir(mode=0o700)
    sock_path = state / "broker.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    listener.listen(8)
    try:
        config = XhpcConfig(state_dir=state, broker=BrokerConfig(socket_group=GROUP))
        _share(state, sock_path, config, socket_group_id(GROUP))
        assert (state.stat().st_gid, state.stat().st_mode & 0o777) == (gid, 0o710)
        assert (sock_path.stat().st_gid, sock_path.stat().st_mode & 0o777) == (gid, 0o660)
        assert connects(IN_GROUP_UID, [gid], sock_path)
        assert not connects(OTHER_UID, [], sock_path)
        # Without a group: the owner alone.
        _share(state, sock_path, XhpcConfig(state_dir=state), None)
        assert sock_path.stat().st_mode & 0o777 == 0o600
        assert not connects(IN_GROUP_UID, [gid], sock_path)
    finally:
        listener.close()


def test_an_unknown_group_or_one_the_user_is_not_in_is_a_one_line_error() -> None:
    with pytest.raises(XhpcError, match="no group named 'no-such-group-xhpc'"):
        socket_group_id("no-such-group-xhpc")
    probe = (
        "import os,sys; from xhpc.broker.server import socket_group_id\n"
        "try: socket_group_id(sys.argv[1])\n"
        "except Exception as e: print(type(e).__name__, e)\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
         sys.executable, "-c", probe, GROUP],
        capture_output=True, text=True, timeout=60, cwd=root,
    )  # fmt: skip
    if "Permission denied" in done.stderr:
        pytest.skip("this checkout's interpreter is not readable by another uid")
    assert "XhpcError broker.socket_group: you are not a member of group 'users'" in done.stdout
