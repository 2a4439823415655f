"""A member's broker shares its control socket with a group (the lab gateway's user): members
of the group connect, other users do not; a group that does not exist, or that the broker's
user is not in, is a one-line error before anything starts. Of those who connect, the broker
answers its own user, admins and proxy users only (the gateway), never another member of the
group. Real sockets, real Unix users."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import SYSTEM_PYTHON, free_port, needs_other_users, package_copy_env
from tests.test_control_authz import CLIENT  # one client of the control socket, as another uid
from tests.unit.test_broker_service import RecordingSlurm
from xhpc.access import Caller
from xhpc.broker.admit import authz
from xhpc.broker.api import MAX_CONTROL_BODY, control_app, sole_socket
from xhpc.broker.relay import RelayKey, relay_app
from xhpc.broker.server import _share, socket_group_id
from xhpc.broker.service import BrokerService
from xhpc.errors import XhpcError
from xhpc.models import ProxyLoad, ServeRequest
from xhpc.settings import BrokerConfig, XhpcConfig
from xhpc.slurm.parse import parse_sinfo_json
from xhpc.store import Store

PYTHON = "/usr/bin/python3"
GROUP = "users"  # a group every Debian system has
IN_GROUP_UID, OTHER_UID = 4251, 4252
DATA = Path(__file__).resolve().parent / "data" / "slurm"

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
    done = subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
         SYSTEM_PYTHON, "-c", probe, GROUP],
        capture_output=True, text=True, timeout=60, cwd="/tmp",
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **package_copy_env()},
    )  # fmt: skip
    assert "XhpcError broker.socket_group: you are not a member of group 'users'" in done.stdout


# --- a member's broker serves its own user, admins and the gateway only ---

GATEWAY_UID, ADMIN_UID = 4253, 4254


async def call_as(
    uid: int, groups: list[int], sock: Path, calls: list[tuple[str, str, str | None]]
) -> list[tuple[int, object]]:
    """Each call made from a process of ``uid`` (in ``groups``) over the socket ``sock``."""
    client = sock.parent.parent / "client.py"
    argv = [PYTHON, "-I", "-S", str(client), str(sock)]
    if uid != os.getuid():
        ids = ["setpriv", f"--reuid={uid}", f"--regid={uid}"]
        ids += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
        argv = [*ids, *argv]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LC_ALL": "C.UTF-8"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(calls).encode()), 30)
    except TimeoutError:
        proc.kill()  # this test's own client
        await proc.wait()
        raise
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}: {err.decode()}"
    return [(status, json.loads(body or "null")) for status, body in json.loads(out)]


@pytest.mark.adversarial
@pytest.mark.parametrize("way", ["socket", "relay"])
async def test_a_member_broker_refuses_the_other_members_of_its_socket_group(
    shared_tmp: Path, tmp_path: Path, way: str
) -> None:
    """Failed on 6d94085 before the fix: with ``broker.socket_group`` set so that the gateway's
    user reaches a member's broker, every other member of that group reached it too and its
    ``POST /v1/serve`` (rule ``anyone``) submitted a job as the broker's user: member A
    submitted jobs as member B. Now the broker answers its own user (and root), its admins and
    its proxy users; anyone else gets a 403 for every endpoint but liveness, before any
    handler. The same through a standby's relay on its socket (a member's broker on two login
    nodes: the leader's control API over TCP), the caller's uid carried to the leader."""
    gid = grp.getgrnam(GROUP).gr_gid
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    broker = BrokerConfig(
        socket_group=GROUP, proxy_users=[f"uid{GATEWAY_UID}"], admins=[f"uid{ADMIN_UID}"]
    )
    state = shared_tmp / "state"
    config = XhpcConfig(state_dir=state, models_dir=tmp_path / "models", broker=broker)
    state.mkdir(mode=0o700)
    store = Store(tmp_path / "x.db")
    slurm = RecordingSlurm(parse_sinfo_json((DATA / "sinfo-idle.json").read_text()), store)
    service = BrokerService(config, store, slurm)
    (shared_tmp / "client.py").write_text(CLIENT)
    (shared_tmp / "client.py").chmod(0o644)
    sock = state / "broker.sock"
    runners = []
    app = control_app(service)
    if way == "relay":
        key = RelayKey("a member's state's relay key")
        leader = web.AppRunner(control_app(service, "token", key), access_log=None)
        await leader.setup()
        port = free_port()
        await web.TCPSite(leader, "127.0.0.1", port).start()
        runners.append(leader)
        found = {"control_url": f"http://127.0.0.1:{port}", "relay": True}
        (shared_tmp / "broker.json").write_text(json.dumps(found))
        app = relay_app(shared_tmp / "broker.json", key, MAX_CONTROL_BODY)
    runner = web.AppRunner(app, access_log=None)
    runners.append(runner)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    _share(state, sock, config, socket_group_id(GROUP))
    serve = ServeRequest(model=str(model_dir), name="stolen").model_dump_json()
    sync = ProxyLoad(proxy_id="gw", table_version=0).model_dump_json()
    try:
        calls: list[tuple[str, str, str | None]] = [
            ("POST", "/v1/serve", serve),
            ("GET", "/v1/replicas?all=1", None),
            ("GET", "/v1/deployments", None),
            ("POST", "/v1/batches", "{}"),
            ("POST", "/v1/stop", '{"target": "stolen"}'),
            ("POST", "/v1/proxy/sync", sync),
            ("GET", "/v1/no-such-endpoint", None),
        ]
        answers = await call_as(IN_GROUP_UID, [gid], sock, [*calls, ("GET", "/v1/health", None)])
        *refused, health = answers
        for (method, path, _), (status, body) in zip(calls, refused, strict=True):
            assert status == 403, f"{method} {path}: {status} {body}"
            assert body["error"]["code"] == "forbidden", body  # type: ignore[index]
        assert "you are uid4251" in refused[0][1]["error"]["message"]  # type: ignore[index]
        assert health == (200, {"status": "ok"})
        assert slurm.submitted == [] and service.deployments() == []

        # The gateway's user (a proxy user) reads routes; an admin and the owner serve.
        ((status, _),) = await call_as(GATEWAY_UID, [gid], sock, [("POST", "/v1/proxy/sync", sync)])
        assert status == 200
        admin = ServeRequest(model=str(model_dir), name="admins").model_dump_json()
        ((status, body),) = await call_as(ADMIN_UID, [gid], sock, [("POST", "/v1/serve", admin)])
        assert status == 200, body
        ((status, body),) = await call_as(os.getuid(), [], sock, [("POST", "/v1/serve", serve)])
        assert status == 200, body
        assert {d.name for d in service.deployments()} == {"admins", "stolen"}
        assert len(slurm.submitted) == 2
    finally:
        for each in runners:
            await each.cleanup()


def test_a_lab_broker_keeps_its_table_for_every_member() -> None:
    """``shared_socket`` (a lab broker: every member reaches it) keeps the table's rules even
    with a ``socket_group``; so does a personal broker (socket 0600)."""
    member = Caller(user="bob", uid=IN_GROUP_UID)
    serve = authz.rule_for("POST", "/v1/serve")
    lab = BrokerConfig(shared_socket=True, socket_group=GROUP)
    assert not sole_socket(lab) and not sole_socket(BrokerConfig())
    assert sole_socket(BrokerConfig(socket_group=GROUP))
    assert authz.permits(serve, member)
    assert not authz.permits(serve, member, sole_uid=0)
    for trusted in (
        Caller(user="root", uid=0),
        Caller(user="me", uid=1000),
        Caller(user="ann", uid=1002, admin=True),
        Caller(user="gw", uid=1003, proxy=True),
    ):
        assert authz.permits(serve, trusted, sole_uid=1000), trusted
    assert authz.permits(authz.rule_for("GET", "/v1/health"), member, sole_uid=0)
    assert not authz.permits(authz.rule_for("GET", "/v1/routes"), member, sole_uid=0)
