"""The control API on a real Unix socket, called by real Unix users (no Slurm needed).

The broker (this process, root) serves ``control_app`` on a socket any local user may reach,
as a lab broker does (``broker.shared_socket``). A small stdlib-only client speaks HTTP over the
socket as four callers: the owner of every deployment (this test's own uid), another member
(uid 4242), an admin (uid 4243, in ``broker.admins``) and a proxy user (uid 4244, in
``broker.proxy_users``); the other uids run it through ``setpriv``. Every endpoint of the access
table is called by each, and its answer checked: allowed is 200, refused is 403 with the JSON
error shape. No engine secret or key digest ever reaches the member.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import free_port, needs_other_users
from tests.unit.test_broker_service import RecordingSlurm
from xhpc.access import Caller, KeyCreate, UsageCount
from xhpc.batch.spec import BatchRequest
from xhpc.broker.admit import authz
from xhpc.broker.api import MAX_CONTROL_BODY, control_app
from xhpc.broker.desks import proxy_desk
from xhpc.broker.relay import RelayKey, relay_app
from xhpc.broker.service import BrokerService
from xhpc.client.http import BrokerTransport
from xhpc.clock import utcnow
from xhpc.engine_config import ModelEngineConfig
from xhpc.errors import BrokerError
from xhpc.models import (
    AgentRegistration,
    AgentReport,
    EngineKind,
    ProxyLoad,
    ServeRequest,
    StagedCopy,
)
from xhpc.orphans import OrphanFixRequest, OrphanPolicy
from xhpc.records import AdapterRecord
from xhpc.settings import BrokerConfig, XhpcConfig
from xhpc.slurm.parse import parse_sinfo_json
from xhpc.store import Store
from xhpc.weights import CachePull

DATA = Path(__file__).resolve().parent / "data" / "slurm"
PYTHON = "/usr/bin/python3"  # the system's: another uid may not read this checkout's venv
MEMBER_UID, ADMIN_UID, PROXY_UID = 4242, 4243, 4244
# Who a call to the Batch API acts for (xhpc.access.ACTING_USER_HEADER, ACTING_KEY_HEADER).
ACTING_USER_HEADER, ACTING_KEY_HEADER = "X-Xhpc-Acting-User", "X-Xhpc-Acting-Key"

pytestmark = [needs_other_users, pytest.mark.security]

CLIENT = """\
import http.client, json, socket, sys

class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("broker", timeout=10)
        self.unix_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock

answers = []
for method, path, body, *more in json.load(sys.stdin):
    conn = UnixConnection(sys.argv[1])
    headers = {"Content-Type": "application/json"} if body is not None else {}
    headers.update(more[0] if more else {})
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    answers.append([resp.status, resp.read().decode()])
    conn.close()
json.dump(answers, sys.stdout)
"""


def user_name(uid: int) -> str:
    """The name the broker gives a uid (xhpc.broker.api.peer_caller)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


Call = tuple[str, str, str | None] | tuple[str, str, str | None, dict[str, str]]
OWNER, MEMBER, ADMIN, PROXY = "owner", "member", "admin", "proxy"
UIDS = {OWNER: os.getuid(), MEMBER: MEMBER_UID, ADMIN: ADMIN_UID, PROXY: PROXY_UID}
EVERYONE = frozenset(UIDS)


@dataclass
class Lab:
    service: BrokerService
    sock: Path
    client: Path
    model_dir: Path
    secret: str
    keys: dict[str, str]  # caller -> the id of a key it may revoke
    member_key: str
    other_key: str
    batch_id: str  # the owner's, ended

    async def call(self, who: str, calls: list[Call]) -> list[Answer]:
        """Each call (method, path, body, and maybe headers) made as ``who`` from a process of
        its own uid: (status, body) each."""
        uid = UIDS[who]
        argv = [PYTHON, "-I", "-S", str(self.client), str(self.sock)]
        if uid != os.getuid():
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        out = await run_client(argv, json.dumps(calls), cwd=self.client.parent)
        return [Answer(status, body) for status, body in json.loads(out)]


@dataclass
class Answer:
    status: int
    body: str

    def json(self) -> object:
        return json.loads(self.body)


async def run_client(argv: list[str], stdin: str, cwd: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LC_ALL": "C.UTF-8"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 30)
    except TimeoutError:
        proc.kill()  # this test's own client
        await proc.wait()
        raise
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}: {err.decode()}"
    return out.decode()


@pytest.fixture(params=["socket", "relay"])
async def lab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[Lab]:
    """The broker on its socket; or ("relay") the leader's control API over TCP behind a
    standby's relay on the socket (xhpc.broker.relay): every caller's uid reaches the leader
    in the relay's signed call, and every answer is the same."""
    # POST /v1/proxy/grants (as a proxy user) makes "p" a proxy heard from lately: each key
    # created after it would wait the whole propagation time (5 s) for "p", which never syncs
    # again. What is checked here is who may call what, not that wait.
    monkeypatch.setattr(proxy_desk, "KEY_PROPAGATION_S", 0.1)
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    broker = BrokerConfig(
        shared_socket=True, admins=[user_name(ADMIN_UID)], proxy_users=[user_name(PROXY_UID)]
    )
    config = XhpcConfig(state_dir=tmp_path / "state", models_dir=tmp_path / "models", broker=broker)
    store = Store(tmp_path / "state" / "x.db")
    nodes = parse_sinfo_json((DATA / "sinfo-idle.json").read_text())
    service = BrokerService(config, store, RecordingSlurm(nodes, store))

    # Three deployments of the owner's; a-0 is READY, so the routing table holds its secret.
    me = Caller(user=user_name(os.getuid()), uid=os.getuid(), admin=True, proxy=True)
    for name in ("a", "b", "c"):
        await service.serve(ServeRequest(model=str(model_dir), name=name), me)
    # One with room for LoRA adapters, an adapter directory of the owner's, and one adapter of
    # the owner's for each caller to try to remove.
    lora = ModelEngineConfig(lora={"max_lora_rank": 8})
    lora_req = ServeRequest(model=str(model_dir), name="l", engine=EngineKind.VLLM,
                            engine_config=lora)  # fmt: skip
    await service.serve(lora_req, me)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    for who in UIDS:
        service.adapter_desk.adapters.add(
            AdapterRecord(
                name=f"rm-{who}",
                base="l",
                path=str(adapter),
                owner=me.user,
                digest="d",
                created_at=utcnow(),
                base_created_at=service.store.get_deployment("l").created_at,
            )
        )
    job = str(service.store.replica("a-0").job_id)
    service.agents.report(AgentReport(replica_id="a-0", job_id=job, phase="starting"))
    reg = AgentRegistration(
        replica_id="a-0", job_id=job, node="n1", host="10.0.0.1", port=9000, served_model="a"
    )
    service.agents.register(reg)
    secret = str(service.store.replica("a-0").engine_secret)
    assert len(secret) > 20 and service.routes().routes[0].secret == secret

    # A batch of the owner's, cancelled and finalized: its results can be read.
    one_line = json.dumps({"custom_id": "q", "url": "/v1/chat/completions", "body": {}})
    one_input = service.batches.inputs.save(me.user, one_line)
    batch = await service.batches.create(BatchRequest(model=str(model_dir), input_id=one_input), me)
    await service.batches.cancel(batch.id, me)
    await service.batches.refresh([])

    member_key, _ = service.keys.create(KeyCreate(user=user_name(MEMBER_UID)))
    other_key, _ = service.keys.create(KeyCreate(user="alice"))
    one = UsageCount(requests=1, prompt_tokens=10, completion_tokens=5)
    service.keys.add_usage({member_key.key_id: {"a": one}, other_key.key_id: {"a": one}})
    keys = {who: service.keys.create(KeyCreate(user="carol"))[0].key_id for who in UIDS}

    # The socket's directory: readable by every uid (the client script lives there too).
    shared = Path(tempfile.mkdtemp(prefix="xhpc-authz-", dir="/tmp"))
    shared.chmod(0o755)
    client = shared / "client.py"
    client.write_text(CLIENT)
    client.chmod(0o644)
    sock = shared / "broker.sock"
    runners = []
    if request.param == "relay":
        key = RelayKey("the state's relay key")
        leader = web.AppRunner(control_app(service, "a control token", key), access_log=None)
        await leader.setup()
        site = web.TCPSite(leader, "127.0.0.1", free_port())
        await site.start()
        url = site.name
        (shared / "broker.json").write_text(json.dumps({"control_url": url, "relay": True}))
        runners.append(leader)
        app = relay_app(shared / "broker.json", key, MAX_CONTROL_BODY)
    else:
        app = control_app(service)
    runner = web.AppRunner(app, access_log=None)
    runners.append(runner)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    sock.chmod(0o666)
    try:
        yield Lab(
            service,
            sock,
            client,
            model_dir,
            secret,
            keys,
            member_key.key_id,
            other_key.key_id,
            batch.id,
        )
    finally:
        for each in runners:
            await each.cleanup()
        shutil.rmtree(shared, ignore_errors=True)


RULE = ("POST", "/v1/batches")


def acting(who: str, endpoint: tuple[str, str]) -> dict[str, str]:
    rule = authz.rule_for(*endpoint)
    return {ACTING_USER_HEADER: user_name(UIDS[who])} if rule and rule.acts else {}


def assert_forbidden(answer: Answer, what: str) -> None:
    assert answer.status == 403, f"{what}: {answer.status} {answer.body[:300]}"
    body = answer.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert body["error"]["code"] == "forbidden" and body["error"]["message"], body


# Another user's batch is one that does not exist to the caller: 404, its owner never named.
NOT_FOUND_TO_OTHERS = {
    ("GET", "/v1/batches/{batch_id}"),
    ("GET", "/v1/batches/{batch_id}/output"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
}


def assert_refused(answer: Answer, endpoint: tuple[str, str], what: str) -> None:
    if endpoint not in NOT_FOUND_TO_OTHERS:
        assert_forbidden(answer, what)
        return
    assert answer.status == 404, f"{what}: {answer.status} {answer.body[:300]}"
    assert answer.json()["error"]["code"] == "not_found" and "belongs" not in answer.body, what


async def test_every_endpoint_answers_each_caller_as_the_table_says(lab: Lab) -> None:
    serve = ServeRequest(model=str(lab.model_dir), name="d").model_dump_json()
    report_only = OrphanPolicy(job_without_replica="report", replica_without_job="report")
    fix = OrphanFixRequest(policy=report_only).model_dump_json()
    sync = ProxyLoad(proxy_id="p", table_version=0).model_dump_json()
    grants = json.dumps({"proxy_id": "p", "usage": {lab.member_key: {"a": {"requests": 1}}}})
    stop_target = {OWNER: "c", ADMIN: "b", MEMBER: "a", PROXY: "a"}  # all the owner's
    admins = frozenset({OWNER, ADMIN})
    new_key = json.dumps({"user": user_name(os.getuid())})  # a key's user is a Unix user
    line = json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": {}})
    # Each caller's own input, as if uploaded: a batch names its owner's input only.
    inputs = {who: lab.service.batches.inputs.save(user_name(UIDS[who]), line) for who in UIDS}
    batch = f"/v1/batches/{lab.batch_id}"
    # A node-local copy in the ledger, for `cache rm` to find (dry runs: nothing is removed).
    digest = "sha256:" + "0" * 64
    lab.service.cache.staged(
        "d-0", "n1", StagedCopy(model="tiny", path="/l/t", size_bytes=1, digest=digest)
    )
    proxies = frozenset({OWNER, PROXY})
    adapter_dir = lab.model_dir.parents[1] / "adapter"
    # A pull into the shared store, for its status; each admin caller submits one of its own.
    pulled = await lab.service.cache.pulls.submit(CachePull(model="p", source=str(lab.model_dir)))

    def calls(who: str) -> list[tuple[tuple[str, str], frozenset[str], str, str, str | None]]:
        """(endpoint in the table, who may, method, url, body)."""
        stop = json.dumps({"target": stop_target[who]})
        pull = json.dumps({"model": f"pulled-{who}", "source": str(lab.model_dir)})
        logs_rule = "/v1/replicas/{replica_id}/logs"
        new_batch = json.dumps({"model": str(lab.model_dir), "input_id": inputs[who]})
        return [
            (("GET", "/v1/health"), EVERYONE, "GET", "/v1/health", None),
            (("POST", "/v1/serve"), EVERYONE, "POST", "/v1/serve?dry_run=1", serve),
            (("GET", "/v1/replicas"), EVERYONE, "GET", "/v1/replicas?all=1", None),
            (("GET", "/v1/deployments"), EVERYONE, "GET", "/v1/deployments", None),
            (("GET", "/v1/deployments/{name}"), EVERYONE, "GET", "/v1/deployments/a", None),
            (("GET", "/v1/nodes"), EVERYONE, "GET", "/v1/nodes", None),
            (("GET", "/v1/pilots"), EVERYONE, "GET", "/v1/pilots", None),
            (("GET", "/v1/overview"), EVERYONE, "GET", "/v1/overview?events=5", None),
            (("GET", "/v1/usage"), EVERYONE, "GET", "/v1/usage", None),
            (("POST", "/v1/batch-inputs"), EVERYONE, "POST", "/v1/batch-inputs", line),
            (("POST", "/v1/batches"), EVERYONE, "POST", "/v1/batches", new_batch),
            (("GET", "/v1/batches"), EVERYONE, "GET", "/v1/batches", None),
            (("GET", "/v1/batches/{batch_id}"), admins, "GET", batch, None),
            (("GET", "/v1/batches/{batch_id}/output"), admins, "GET", f"{batch}/output", None),
            (("POST", "/v1/batches/{batch_id}/cancel"), admins, "POST", f"{batch}/cancel", "{}"),
            # Owner-checked targets, all the owner's: admins may too, no one else.
            (("POST", "/v1/scale"), admins, "POST", "/v1/scale", '{"name":"a","replicas":1}'),
            (("POST", "/v1/stop"), admins, "POST", "/v1/stop", stop),
            (("POST", "/v1/deployments/{name}/scaling"), admins, "POST",
             "/v1/deployments/l/scaling", '{"max_replicas":1}'),
            (("GET", logs_rule), admins, "GET", "/v1/replicas/a-0/logs", None),
            (("GET", "/v1/routes"), proxies, "GET", "/v1/routes", None),
            (("POST", "/v1/proxy/sync"), proxies, "POST", "/v1/proxy/sync", sync),
            (("POST", "/v1/proxy/grants"), proxies, "POST", "/v1/proxy/grants", grants),
            (("POST", "/v1/keys"), admins, "POST", "/v1/keys", new_key),
            (("GET", "/v1/keys"), admins, "GET", "/v1/keys", None),
            (("POST", "/v1/keys/{key_id}/revoke"), admins, "POST",
             f"/v1/keys/{lab.keys[who]}/revoke", "{}"),
            (("GET", "/v1/adapters"), EVERYONE, "GET", "/v1/adapters", None),
            (("POST", "/v1/adapters"), admins, "POST", "/v1/adapters", json.dumps(
                {"name": f"n-{who}", "base": "l", "path": str(adapter_dir)})),
            (("POST", "/v1/adapters/{name}/rm"), admins, "POST", f"/v1/adapters/rm-{who}/rm",
             "{}"),
            (("GET", "/v1/cache"), EVERYONE, "GET", "/v1/cache", None),
            (("POST", "/v1/cache/rm"), admins, "POST", "/v1/cache/rm",
             '{"model":"tiny","dry_run":true}'),
            (("POST", "/v1/cache/prune"), admins, "POST", "/v1/cache/prune",
             '{"budget_bytes":0,"dry_run":true}'),
            (("POST", "/v1/cache/pull"), admins, "POST", "/v1/cache/pull", pull),
            (("GET", "/v1/cache/pulls/{pull_id}"), admins, "GET",
             f"/v1/cache/pulls/{pulled.id}", None),
            (("GET", "/v1/orphans"), admins, "GET", "/v1/orphans", None),
            (("GET", "/v1/metrics"), admins | proxies, "GET", "/v1/metrics", None),
            (("POST", "/v1/orphans/fix"), admins, "POST", "/v1/orphans/fix", fix),
        ]  # fmt: skip

    walked = {endpoint for endpoint, *_ in calls(OWNER)}
    assert walked == {(r.method, r.path) for r in authz.RULES}, "walk every endpoint"

    key_digests = [g.digest for g in lab.service.keys.grants()]
    assert key_digests
    for who in (MEMBER, PROXY, ADMIN, OWNER):
        table = calls(who)
        # The Batch API's calls name who they act for: each caller itself.
        answers = await lab.call(
            who, [(m, url, body, acting(who, endpoint)) for endpoint, _, m, url, body in table]
        )
        for (endpoint, allowed, *_), answer in zip(table, answers, strict=True):
            what = f"{who} {endpoint}"
            if who in allowed:
                assert answer.status == 200, f"{what}: {answer.status} {answer.body[:300]}"
            else:
                assert_refused(answer, endpoint, what)
            if who not in proxies:  # no engine secret, no key digest, however it was asked
                assert lab.secret not in answer.body, what
                assert not any(d in answer.body for d in key_digests), what

    # What the allowed calls did: the owner and the admin stopped theirs, the others nothing.
    live = {d.name for d in lab.service.deployments() if d.wanted > 0}
    assert live == {"a", "l"}
    revoked = {k.key_id for k in lab.service.keys.all() if k.revoked_at is not None}
    assert revoked == {lab.keys[OWNER], lab.keys[ADMIN]}
    pulls = {v.model for v in lab.service.cache.pulls.views()}
    assert pulls == {"p", f"pulled-{OWNER}", f"pulled-{ADMIN}"}  # none for a member or a proxy


async def test_another_member_gets_no_routes_and_no_secret(lab: Lab) -> None:
    member = await lab.call(
        MEMBER,
        [
            ("GET", "/v1/routes", None),
            ("HEAD", "/v1/routes", None),
            ("POST", "/v1/proxy/sync", '{"proxy_id": "p", "table_version": 0}'),
            ("GET", "/v1/no-such-endpoint", None),
        ],
    )
    for answer in member:
        assert answer.status == 403 and lab.secret not in answer.body
    assert_forbidden(member[0], "GET /v1/routes")
    assert "you are " + user_name(MEMBER_UID) in member[0].body
    assert_forbidden(member[3], "an endpoint with no rule")
    (mine,) = await lab.call(PROXY, [("GET", "/v1/routes", None)])
    assert mine.status == 200 and lab.secret in mine.body


async def test_usage_reports_are_never_negative_and_members_see_their_own(lab: Lab) -> None:
    before = lab.service.keys.usage()
    reset = json.dumps({"proxy_id": "p", "usage": {lab.member_key: {"a": {"prompt_tokens": -10}}}})
    (refused,) = await lab.call(PROXY, [("POST", "/v1/proxy/grants", reset)])
    assert refused.status == 400, refused.body
    (forbidden,) = await lab.call(MEMBER, [("POST", "/v1/proxy/grants", reset)])
    assert_forbidden(forbidden, "a member's usage report")
    assert lab.service.keys.usage() == before

    (mine,) = await lab.call(MEMBER, [("GET", "/v1/usage", None)])
    (every,) = await lab.call(ADMIN, [("GET", "/v1/usage", None)])
    assert {line["key_id"] for line in mine.json()} == {lab.member_key}  # type: ignore[union-attr]
    assert {line["key_id"] for line in every.json()} == {lab.member_key, lab.other_key}  # type: ignore[union-attr]


async def test_a_refusal_is_one_cli_line(lab: Lab) -> None:
    """The CLI's client turns the 403 into one error line (here as the owner: an endpoint with
    no rule is refused to every socket caller)."""
    client = BrokerTransport(lab.sock, timeout_s=10)
    with pytest.raises(BrokerError) as info:
        await asyncio.to_thread(client.get, "/v1/no-such-endpoint")
    assert info.value.status == 403 and info.value.code == "forbidden"
    assert "\n" not in info.value.one_line() and "not an endpoint" in info.value.one_line()


@pytest.mark.adversarial
async def test_the_proxy_identity_acts_as_the_user_it_names_and_never_as_an_admin(
    lab: Lab,
) -> None:
    """Failed on 6d94085 before the fix: the proxy's identity (the broker's own user here) was
    an admin on the Batch API whatever user it said it acted for, and an acting user named on
    any other endpoint was ignored (a gateway call gone astray revoked a key with admin
    rights)."""
    batch = f"/v1/batches/{lab.batch_id}"
    as_member = {ACTING_USER_HEADER: user_name(MEMBER_UID)}
    revoke = f"/v1/keys/{lab.keys[OWNER]}/revoke"
    nameless, for_member, listed, revoked, bad_name = await lab.call(
        OWNER,
        [
            ("GET", batch, None),
            ("GET", batch, None, as_member),
            ("GET", "/v1/batches", None, as_member),
            ("POST", revoke, "{}", as_member),
            ("GET", batch, None, {ACTING_USER_HEADER: "../root"}),
        ],
    )
    assert nameless.status == 400 and ACTING_USER_HEADER in nameless.body
    assert_refused(for_member, ("GET", "/v1/batches/{batch_id}"), "the owner's batch, for a member")
    assert listed.status == 200 and listed.json() == []
    assert_forbidden(revoked, "an admin endpoint named an acting user")
    assert lab.keys[OWNER] not in {k.key_id for k in lab.service.keys.all() if k.revoked_at}
    assert bad_name.status == 400

    # A member may name only itself; a key named must be that user's own, and live.
    as_owner = {ACTING_USER_HEADER: user_name(os.getuid())}
    (impostor,) = await lab.call(MEMBER, [("GET", batch, None, as_owner)])
    assert_forbidden(impostor, "a member naming the owner")
    others_key = {**as_member, ACTING_KEY_HEADER: lab.other_key}
    (borrowed,) = await lab.call(PROXY, [("GET", "/v1/batches", None, others_key)])
    assert_forbidden(borrowed, "another user's key")
    own_key = {**as_member, ACTING_KEY_HEADER: lab.member_key}
    (keyed,) = await lab.call(PROXY, [("GET", "/v1/batches", None, own_key)])
    assert keyed.status == 200 and keyed.json() == []


@pytest.mark.adversarial
async def test_a_key_s_batch_names_no_path_and_no_one_else_s_deployment(lab: Lab) -> None:
    """Failed on 6d94085 before the fix: through the proxy's identity a key's batch named any
    path the broker's user could read (refused with "no model at PATH" only when it did not
    exist: an oracle), and an online batch went to another member's deployment, with its
    engine secret."""
    line = json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": {}})
    member = {ACTING_USER_HEADER: user_name(MEMBER_UID), ACTING_KEY_HEADER: lab.member_key}
    upload = lab.service.batches.inputs.save(user_name(MEMBER_UID), line)
    unreadable = lab.model_dir.parent / "locked"
    unreadable.mkdir(mode=0o700)
    (unreadable / "config.json").write_text("{}")
    models = [str(lab.model_dir), str(unreadable), "/no/such/model", "../models/m", "~root/m"]
    calls: list[Call] = [
        ("POST", "/v1/batches", json.dumps({"model": m, "input_id": upload}), member)
        for m in models
    ]
    calls.append(("POST", "/v1/batches", json.dumps({"model": "a", "input_id": upload}), member))
    online = json.dumps({"model": "a", "input_id": upload, "online": True})
    calls.append(("POST", "/v1/batches", online, member))
    answers = await lab.call(PROXY, calls)
    messages = set()
    for model, answer in zip([*models, "a"], answers, strict=False):
        assert answer.status == 404, answer.body
        body = answer.json()
        assert isinstance(body, dict)
        messages.add(body["error"]["message"].replace(repr(model[:80]), "MODEL"))
    assert messages == {"unknown model MODEL"}  # the same, whatever is on disk
    assert answers[-1].status == 404 and "no deployment 'a' you may use" in answers[-1].body
    # A member on the socket, acting as itself, may not use the owner's deployment either.
    (direct,) = await lab.call(MEMBER, [("POST", "/v1/batches", online, acting(MEMBER, RULE))])
    assert direct.status == 404 and "you may use" in direct.body
    owned = {v.owner for v in lab.service.batches.all(None)}
    assert owned == {user_name(os.getuid())}  # only the fixture's batch
