"""A lab gateway (decision 0014): one proxy reads the broker of every member. A member broker's
models belong to the Unix user it runs as (its socket's peer credentials), whatever it says;
a name two brokers list goes to the first; keys come from the first broker only.

The member's broker here is a stand-in run as another Unix user (uid 4242, through
``setpriv``): a stdlib-only HTTP server on its own Unix socket that answers what a broker
would, and lies where a hostile member would (an admin key of its own, another member's model
name, an owner that is not itself)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import needs_other_users
from tests.proxy_fakes import Stack, chat, open_stack, serve
from xhpc.access import Grants, KeyGrant, ModelAccess, new_key
from xhpc.models import Route, RoutingTable
from xhpc.proxy import Router, make_app
from xhpc.proxy.lab import BrokerLink, lab_grants, merge
from xhpc.proxy.source import BrokerRouteSource
from xhpc.proxy.tenants.keys import GrantSource, KeyBook

MEMBER_UID = 4242
MEMBER = f"uid{MEMBER_UID}"  # no passwd entry: the name the gateway gives it
PYTHON = "/usr/bin/python3"


def route(model: str, rid: str, url: str = "http://x.invalid") -> Route:
    return Route(model=model, replica_id=rid, url=url, served_model=model)


def table(version: int, models: tuple[str, ...], *routes: Route) -> RoutingTable:
    return RoutingTable(version=version, models=models, routes=routes)


# --- the merge (pure) ---


def test_one_broker_is_served_as_it_is() -> None:
    t = table(7, ("a",), route("a", "a-0"))
    lab = merge([BrokerLink(Path("/s"), table=t)])
    assert lab.table == t and lab.broker_of == {"a": 0} and lab.conflicts == ()


def test_a_name_two_brokers_list_goes_to_the_first() -> None:
    first = BrokerLink(Path("/a"), table=table(1, ("a", "shared"), route("shared", "s-0")))
    second = BrokerLink(
        Path("/b"), table=table(2, ("b", "shared"), route("b", "b-0"), route("shared", "x-0"))
    )
    lab = merge([first, second])
    assert lab.broker_of == {"a": 0, "shared": 0, "b": 1}
    assert {r.replica_id for r in lab.table.routes} == {"s-0", "b-0"}
    assert [(c.model, c.kept, c.ignored) for c in lab.conflicts] == [("shared", 0, 1)]
    assert lab.table.models == ("a", "b", "shared")
    assert merge([first, second]).table.version == lab.table.version  # a digest of theirs
    second.table = table(3, ("b",))
    assert merge([first, second]).table.version != lab.table.version


def test_a_broker_not_heard_from_adds_nothing() -> None:
    first = BrokerLink(Path("/a"), table=table(1, ("a",), route("a", "a-0")))
    lab = merge([first, BrokerLink(Path("/b"))])
    assert lab.broker_of == {"a": 0} and [r.replica_id for r in lab.table.routes] == ["a-0"]


def test_keys_come_from_the_first_broker_and_owners_from_who_runs_each() -> None:
    _, _, digest = new_key()
    authority = Grants(
        keys=(KeyGrant(key_id="k", digest=digest, user="alice"),),
        access=(ModelAccess(model="a", owner="alice"), ModelAccess(model="b", owner="alice")),
    )
    member = BrokerLink(
        Path("/b"),
        user="bob",
        access=(
            ModelAccess(model="b", owner="root", account="lab2"),  # it says root: not so
            ModelAccess(model="a", owner="bob"),  # not its model
        ),
    )
    nobody = BrokerLink(Path("/c"))  # not heard from: its models are admins' only
    grants = lab_grants(
        authority, [BrokerLink(Path("/a")), member, nobody], {"a": 0, "b": 1, "c": 2}
    )
    assert grants.keys == authority.keys
    assert set(grants.access) == {
        ModelAccess(model="a", owner="alice"),
        ModelAccess(model="b", owner="bob", account="lab2"),
        ModelAccess(model="c", owner=None),
    }
    assert lab_grants(authority, [BrokerLink(Path("/a"))], {"a": 0}) is authority


# --- a real second Unix user's broker ---

STAND_IN = """\
import http.server, json, os, socketserver, sys

path, answers = sys.argv[1], json.load(open(sys.argv[2]))

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps(answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def address_string(self):
        return "member"

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

with Server(path, Handler) as server:
    open(path + ".ready", "w").close()
    server.serve_forever()
"""


@pytest.fixture
def member_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="xhpc-member-"))
    os.chown(d, MEMBER_UID, MEMBER_UID)
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def member_broker(d: Path, answers: dict[str, object]) -> subprocess.Popen[bytes]:
    (d / "stand_in.py").write_text(STAND_IN)
    (d / "answers.json").write_text(json.dumps(answers))
    for f in ("stand_in.py", "answers.json"):
        (d / f).chmod(0o644)
    argv = ["setpriv", f"--reuid={MEMBER_UID}", f"--regid={MEMBER_UID}", "--clear-groups"]
    sock = d / "broker.sock"
    proc = subprocess.Popen(
        [*argv, PYTHON, str(d / "stand_in.py"), str(sock), str(d / "answers.json")],
        env={"HOME": "/tmp", "PATH": "/usr/bin:/bin"},
    )
    for _ in range(200):
        if (d / "broker.sock.ready").exists() or proc.poll() is not None:
            break
        await asyncio.sleep(0.05)
    assert proc.poll() is None, "the member's broker did not start"
    return proc


class Authority:
    """The first broker (this process): its table and the lab's keys."""

    def __init__(self, t: RoutingTable, grants: Grants) -> None:
        self.t, self.grants = t, grants

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/proxy/sync", self.sync)
        app.router.add_post("/v1/proxy/grants", self.grant)
        return app

    async def sync(self, request: web.Request) -> web.Response:
        return web.json_response(text=self.t.model_dump_json())

    async def grant(self, request: web.Request) -> web.Response:
        return web.json_response(text=self.grants.model_dump_json())


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with open_stack() as s:
        yield s


@needs_other_users
@pytest.mark.security
async def test_a_lab_gateway_serves_each_members_models_as_theirs(
    stack: Stack, member_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await stack.engine("a-0", model="a")
    await stack.engine("b-0", model="b")
    await stack.engine("evil-0", model="a")
    keys: dict[str, str] = {}
    grants = []
    for user, admin in (("alice", False), (MEMBER, False), ("carol", False)):
        key_id, key, digest = new_key()
        grants.append(KeyGrant(key_id=key_id, digest=digest, user=user, admin=admin))
        keys[user] = f"Bearer {key}"
    authority = Authority(
        table(11, ("a",), stack.routes["a-0"]),
        Grants(keys=tuple(grants), access=(ModelAccess(model="a", owner="alice"),)),
    )
    # The member's broker serves "b", also lists "a" (another member's name) and hands out an
    # admin key of its own and an owner that is not itself.
    rogue_id, rogue, rogue_digest = new_key()
    member_table = table(5, ("a", "b"), stack.routes["b-0"], stack.routes["evil-0"])
    member_grants = Grants(
        keys=(KeyGrant(key_id=rogue_id, digest=rogue_digest, user="root", admin=True),),
        access=(ModelAccess(model="b", owner="alice"),),
    )
    proc = await member_broker(
        member_dir,
        {
            "/v1/proxy/sync": json.loads(member_table.model_dump_json()),
            "/v1/proxy/grants": json.loads(member_grants.model_dump_json()),
        },
    )
    try:
        own = tmp_path / "broker.sock"
        router, book = Router(), KeyBook()
        app = make_app(router, keys=book)
        routes = BrokerRouteSource([own, member_dir / "broker.sock"], interval_s=0.05)
        routes.install(app)
        GrantSource(own, book, 0.05, routes).install(app)
        with caplog.at_level(logging.WARNING, logger="xhpc.proxy.source"):
            async with serve(authority.app(), unix_path=own), serve(app) as url:
                stack.url = url
                for _ in range(100):
                    if router.knows("b") and book.access.get("b") is not None:
                        break
                    await asyncio.sleep(0.05)
                assert [link.user for link in routes.links] == ["root", MEMBER]

                async def ask(model: str, user: str) -> tuple[int, object]:
                    headers = {"Authorization": keys[user]}
                    status, _, body = await stack.post("/v1/chat/completions", chat(model), headers)
                    return status, body

                status, body = await ask("b", MEMBER)
                assert status == 200, body
                assert body["choices"][0]["message"]["content"] == "hello from b-0"  # type: ignore[index]
                # alice is not b's owner, whatever the member's broker said
                assert (await ask("b", "alice"))[0] == 404  # as if it did not exist
                assert (await ask("b", "carol"))[0] == 404
                # "a" stays alice's, on her broker's replica; the member's is never routed
                for _ in range(4):
                    status, body = await ask("a", "alice")
                    assert status == 200, body
                    assert body["choices"][0]["message"]["content"] == "hello from a-0"  # type: ignore[index]
                assert (await ask("a", MEMBER))[0] == 404
                # the member's own "admin" key is no key at all
                status, _, _ = await stack.post(
                    "/v1/chat/completions", chat("b"), {"Authorization": f"Bearer {rogue}"}
                )
                assert status == 401
        assert stack.engines["evil-0"].received == []
        conflicts = [r.getMessage() for r in caplog.records if "lists it too" in r.getMessage()]
        assert len(conflicts) == 1 and "'a'" in conflicts[0]
    finally:
        proc.terminate()
        proc.wait(10)
