"""Properties of the control API as two Unix users: whatever another member sends over the
broker's socket, the broker answers it without a 5xx, never shows it the owner's secrets, never
changes the owner's things, and puts no unvalidated value in a job script.

A lab broker (``broker.shared_socket``) is served from a thread of this process (root, the
broker's own user, who owns every planted thing: three deployments, one READY with its engine
secret; a batch with results and metadata; an uploaded input; keys with usage; a replica's log;
a pull). The other member is uid 4246: one long-lived stdlib-only client run as that uid
(``setpriv``) reads raw HTTP requests from its stdin, one a line, sends each over the socket and
writes the answer back. Hypothesis draws each request: an endpoint of the access table (or none)
with hostile and real path parameters, a hostile query, a body shaped like the endpoint's own or
anything at all (not JSON, not UTF-8, nested deep), and acting-user headers naming the member,
the owner or nonsense. After each answer: its status is under 500; a 4xx is the JSON error
object; no planted secret is in it, and no id of the owner's that the request did not name; the
owner's deployments, keys, batches, results, inputs, usage, pulls and routes are as they were;
and every script the broker wrote or showed (the recording Slurm's, a dry run's) passes
``tests.props_support.directive_problems``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import SYSTEM_PYTHON, as_uid, needs_other_users
from tests.props_support import (
    BackgroundLoop,
    CapturingSlurm,
    directive_problems,
    end_deployments,
    hostile_text,
    options,
)
from xhpc.access import ACTING_KEY_HEADER, ACTING_USER_HEADER, Caller, KeyCreate, UsageCount
from xhpc.batch.lines import ProgressFile
from xhpc.batch.spec import BatchRequest, progress_path
from xhpc.broker.admit import authz
from xhpc.broker.api import MAX_CONTROL_BODY, control_app
from xhpc.broker.service import BrokerService
from xhpc.errors import NotFoundError
from xhpc.models import AgentRegistration, AgentReport, ServeRequest
from xhpc.peers import user_name
from xhpc.settings import BrokerConfig, XhpcConfig
from xhpc.slurm.parse import parse_sinfo_json
from xhpc.store import Store
from xhpc.weights import CachePull

pytestmark = [needs_other_users, pytest.mark.security, pytest.mark.adversarial]

DATA = Path(__file__).resolve().parent / "data" / "slurm"
MEMBER_UID = 4246
OWNER, MEMBER = user_name(os.getuid()), user_name(MEMBER_UID)
PROPS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# The member's client: [method, raw HTTP request in hex] per stdin line, [status, body] per
# stdout line (status 0: no answer).
CLIENT = """\
import http.client, json, socket, sys

for line in sys.stdin:
    method, raw = json.loads(line)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(30)
        sock.connect(sys.argv[1])
        sock.sendall(bytes.fromhex(raw))
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        out = [resp.status, resp.read().decode("utf-8", "replace")]
    except Exception as err:
        out = [0, f"{type(err).__name__}: {err}"]
    finally:
        sock.close()
    print(json.dumps(out), flush=True)
"""


@dataclass
class Lab:
    """The broker, the member's client, and what the owner planted."""

    loop: BackgroundLoop
    service: BrokerService
    slurm: CapturingSlurm
    client: subprocess.Popen[str]
    model_dir: Path
    secrets: list[str]  # never in a member's answer
    ids: dict[str, str]  # placeholder -> the owner's (or member's) real id
    owner_ids: list[str] = field(default_factory=list)  # in an answer only once the member named it
    named: set[str] = field(default_factory=set)  # the owner's ids the member named so far
    checked_scripts: int = 0
    names: int = 0  # fresh deployment names given out
    seen_batches: set[str] = field(default_factory=set)
    owner_batches: set[str] = field(default_factory=set)

    def call(self, method: str, raw: bytes) -> tuple[int, str]:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(json.dumps([method, raw.hex()]) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        assert line, "the member's client ended"
        status, body = json.loads(line)
        return int(status), str(body)

    def fresh_input(self) -> str:
        """A new input of the member's, as if it had uploaded it."""
        line = json.dumps({"custom_id": "q", "url": "/v1/chat/completions", "body": {}})

        async def save() -> str:
            return self.service.batches.inputs.save(MEMBER, line)

        return self.loop.run(save())

    def stop_member_s_new(self) -> None:
        """The member's deployments but "mine" stopped, their jobs ended."""
        self.loop.run(end_deployments(self.service, MEMBER, frozenset({"mine"})))

    def owner_state(self) -> object:
        """Everything of the owner's a member could try to read or change: its deployments
        and replicas as stored (engine secrets, tokens' digests, states), every key, its batches,
        results and unused input, usage, pulls."""

        async def read() -> object:
            s = self.service
            deployments = [s.store.get_deployment(n).model_dump() for n in ("a", "b", "c")]
            replicas = [
                r.model_dump() for n in ("a", "b", "c") for r in s.store.replicas(deployment=n)
            ]
            keys = [k.model_dump() for k in s.keys.all()]
            for path in s.batches.root.iterdir():  # batches made since: whose are they?
                if path.name not in self.seen_batches:
                    try:
                        owner = s.batches.get(path.name, None).owner
                    except NotFoundError:  # not a whole batch (yet)
                        continue
                    self.seen_batches.add(path.name)
                    if owner == OWNER:
                        self.owner_batches.add(path.name)
            batches = [s.batches.get(b, None).model_dump() for b in sorted(self.owner_batches)]
            output = s.batches.output(self.ids["@OWNER_BATCH@"], None)
            usage = [u.model_dump() for u in s.keys.usage()]
            pulls = [v.model_dump() for v in s.cache.pulls.views()]
            kept = s.batches.inputs.path(OWNER, self.ids["@OWNER_INPUT@"]).read_text()
            return deployments, replicas, keys, batches, output, usage, pulls, kept

        return self.loop.run(read())


Planted = tuple[list[str], dict[str, str]]  # (secrets, ids)


async def plant(lab_dir: Path, service: BrokerService, model_dir: Path) -> Planted:
    """The owner's things (and a deployment and a batch of the member's), as each made them;
    the secrets a member must never see, and the ids its requests may name."""
    me = Caller(user=OWNER, uid=os.getuid(), admin=True, proxy=True)
    member = Caller(user=MEMBER, uid=MEMBER_UID)
    for name in ("a", "b", "c"):
        await service.serve(ServeRequest(model=str(model_dir), name=name), me)
    await service.serve(ServeRequest(model=str(model_dir), name="mine"), member)
    job = str(service.store.replica("a-0").job_id)
    service.agents.report(AgentReport(replica_id="a-0", job_id=job, phase="starting"))
    service.agents.register(
        AgentRegistration(
            replica_id="a-0", job_id=job, node="n1", host="10.0.0.1", port=9000, served_model="a"
        )
    )
    secret = str(service.store.replica("a-0").engine_secret)
    replica_dir = Path(str(service.store.replica("a-0").replica_dir))
    (replica_dir / f"slurm-{job}.out").write_text("LOG-MARK-the-owner-s-prompt\n")

    # A batch of the owner's with results, and an input it has not used yet.
    line = json.dumps({"custom_id": "q", "url": "/v1/chat/completions", "body": {}})
    first = service.batches.inputs.save(OWNER, line)
    req = BatchRequest(model=str(model_dir), input_id=first, metadata={"run": "META-MARK-run"})
    batch = await service.batches.create(req, me)
    progress = ProgressFile(progress_path(service.batches.root / batch.id, 0))
    progress.add(0, True, {"custom_id": "q", "response": {"body": "OUTPUT-MARK-answer"}})
    progress.close()
    await service.batches.cancel(batch.id, me)
    await service.batches.refresh([])
    assert "OUTPUT-MARK" in service.batches.output(batch.id, None)
    unused = service.batches.inputs.save(OWNER, line.replace('"q"', '"INPUT-MARK"'))
    mine = service.batches.inputs.save(MEMBER, line)
    member_batch = await service.batches.create(
        BatchRequest(model=str(model_dir), input_id=mine), member
    )

    owner_key, owner_raw = service.keys.create(KeyCreate(user=OWNER))
    member_key, _ = service.keys.create(KeyCreate(user=MEMBER))
    one = UsageCount(requests=7, prompt_tokens=7919, completion_tokens=104729)
    service.keys.add_usage({owner_key.key_id: {"a": one}, member_key.key_id: {"mine": one}})

    source = lab_dir / "SOURCE-MARK-weights"
    source.mkdir()
    (source / "config.json").write_text("{}")
    pull = await service.cache.pulls.submit(CachePull(model="pulled", source=str(source)))

    digests = [g.digest for g in service.keys.grants()]
    never = [secret, owner_raw, owner_raw.split(".")[-1], *digests, "LOG-MARK", "META-MARK",
             "OUTPUT-MARK", "INPUT-MARK", "SOURCE-MARK"]  # fmt: skip
    ids = {
        "@OWNER_BATCH@": batch.id, "@OWNER_INPUT@": unused, "@OWNER_KEY@": owner_key.key_id,
        "@PULL@": pull.id, "@MEMBER_BATCH@": member_batch.id, "@MEMBER_KEY@": member_key.key_id,
        "@MODEL@": str(model_dir), "@OWNER@": OWNER, "@MEMBER@": MEMBER,
    }  # fmt: skip
    return never, ids


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("props-control")
    model_dir = root / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    loop = BackgroundLoop()
    shared = Path(tempfile.mkdtemp(prefix="xhpc-props-", dir="/tmp"))  # a short socket path
    shared.chmod(0o755)
    sock = shared / "broker.sock"
    (shared / "client.py").write_text(CLIENT)
    (shared / "client.py").chmod(0o644)

    async def start() -> tuple[BrokerService, CapturingSlurm, web.AppRunner, Planted]:
        config = XhpcConfig(
            state_dir=root / "state", models_dir=root / "models",
            broker=BrokerConfig(shared_socket=True),
        )  # fmt: skip
        store = Store(root / "state" / "x.db")
        nodes = parse_sinfo_json((DATA / "sinfo-idle.json").read_text())
        slurm = CapturingSlurm(nodes, store)
        service = BrokerService(config, store, slurm)
        planted = await plant(root, service, model_dir)
        runner = web.AppRunner(control_app(service), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(sock)).start()
        sock.chmod(0o666)
        return service, slurm, runner, planted

    service, slurm, runner, (never, ids) = loop.run(start())
    client = subprocess.Popen(
        [*as_uid(MEMBER_UID), SYSTEM_PYTHON, "-I", "-S", str(shared / "client.py"), str(sock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=shared,
        env={"PATH": "/usr/bin:/bin", "HOME": str(shared), "LC_ALL": "C.UTF-8"},
    )  # fmt: skip
    owner_ids = [ids[k] for k in ("@OWNER_BATCH@", "@OWNER_INPUT@", "@OWNER_KEY@", "@PULL@")]
    try:
        yield Lab(loop, service, slurm, client, model_dir, never, ids, owner_ids)
    finally:
        assert client.stdin is not None
        client.stdin.close()
        try:
            client.wait(10)
        except subprocess.TimeoutExpired:
            client.kill()  # this test's own client
            client.wait()
        loop.run(runner.cleanup())
        loop.close()
        shutil.rmtree(shared, ignore_errors=True)


# -- what the member sends -------------------------------------------------------------------------
PLACEHOLDERS = ("@OWNER_BATCH@", "@OWNER_INPUT@", "@OWNER_KEY@", "@PULL@", "@MEMBER_BATCH@",
                "@MEMBER_KEY@", "@MODEL@", "@OWNER@", "@MEMBER@")  # fmt: skip
NAMES = st.sampled_from(["a", "b", "c", "a-0", "b-0", "mine", "mine-0", "new", "n1", "pulled"])


def anything() -> st.SearchStrategy[str]:
    """A real name or id (the owner's or the member's), or hostile text."""
    return st.one_of(NAMES, st.sampled_from(PLACEHOLDERS), hostile_text())


JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), anything(),
)  # fmt: skip
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(anything(), inner, max_size=3),
    max_leaves=8,
)
HOSTILE_COUNT = st.sampled_from([-1, 0, 257, 10**20, 1.5, "2", "x", None, True, [1], {}])
HOSTILE_JSON = st.one_of(anything(), JSON, HOSTILE_COUNT)
Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]  # (valid, hostile)


def field_(*valid: Any) -> Field:
    """A field whose valid values are ``valid``, and whose hostile ones are anything."""
    return st.sampled_from(valid), HOSTILE_JSON


def shaped(required: dict[str, Field], optional: dict[str, Field]) -> st.SearchStrategy[Any]:
    """An endpoint's body: its required fields and up to three optional ones, valid but for
    one or two of them (or none), which are hostile."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        fields = {**required, **optional}
        extra = draw(st.sets(st.sampled_from(sorted(optional)), max_size=3)) if optional else set()
        chosen = [*required, *sorted(extra)]
        bad = min(len(chosen), draw(st.sampled_from([0, 0, 1, 1, 2])))
        hostile = (
            draw(st.sets(st.sampled_from(chosen), min_size=bad, max_size=bad)) if bad else set()
        )
        return {k: draw(fields[k][1] if k in hostile else fields[k][0]) for k in chosen}

    return build()


FRESH_NAME: Field = (st.just("@FRESH_NAME@"), HOSTILE_JSON)
TIME: Field = field_("30:00", "01:00:00", "2-00", "UNLIMITED")
REPLICA_CONFIG = shaped({}, {"node": field_("n1", "n2"), "gpus": field_(1, 2),
                             "gpu_type": field_("a100"), "gpu_idx": field_([0], [])})  # fmt: skip
SERVE_FIELDS: dict[str, Field] = {
    "replicas": field_(1, 2), "gpus": field_(1, 2), "partition": field_("gpu"), "time": TIME,
    "nodelist": field_("n1", "n[1-2]", "n3"), "gpu_type": field_("a100"), "pilot": field_("n2"),
    "run_for": TIME, "engine": field_("vllm", "transformers"),
    "let_slurm_place": field_(True, False),
    "engine_args": (st.sampled_from([[], ["--max-model-len", "128"]]),
                    st.lists(hostile_text(), max_size=3)),
    "replica_configs": (st.lists(REPLICA_CONFIG, max_size=1), HOSTILE_JSON),
    "restart": field_("always", "never"), "pd": field_("1P1D"),
}  # fmt: skip
BODIES: dict[str, st.SearchStrategy[Any]] = {
    "/v1/serve": shaped({"model": field_("@MODEL@")}, {"name": FRESH_NAME, **SERVE_FIELDS}),
    "/v1/stop": shaped({"target": (st.sampled_from(["a", "a-0", "mine", "new"]), anything())}, {}),
    "/v1/scale": shaped(
        {
            "name": (st.sampled_from(["a", "b", "mine", "new"]), anything()),
            "replicas": field_(0, 1, 2),
        },
        {},
    ),
    "/v1/batches": shaped(
        {"model": field_("@MODEL@", "mine", "a"), "input_id": field_("@FRESH_INPUT@")},
        {
            "partition": field_("gpu"),
            "qos": field_("normal"),
            "time": TIME,
            "gpus": field_(0, 1),
            "shards": field_(1, 2),
            "concurrency": field_(1, 8),
            "engine": field_("vllm"),
            "endpoint": field_("/v1/chat/completions"),
            "metadata": (st.just({"run": "x"}), st.dictionaries(anything(), anything())),
            "online": field_(False, True),
        },
    ),
    "/v1/keys": shaped({"user": field_("@MEMBER@", "@OWNER@")}, {"admin": field_(True)}),
    "/v1/proxy/grants": shaped(
        {"proxy_id": field_("p"), "usage": field_({"@OWNER_KEY@": {"a": {"requests": -5}}})},
        {},
    ),
    "/v1/cache/pull": shaped({"model": field_("x"), "source": field_("@MODEL@")}, {}),
    "/v1/cache/rm": shaped({"model": field_("m")}, {"dry_run": field_(False)}),
    "/v1/batches/{batch_id}/cancel": st.just({}),
}
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"\xff\xfe{",
            b"{",
            b"[1]",
            b"null",
            b'"x"',
            b"NaN",
            b"[" * 50_000,
            b'{"a":' * 20_000,
            b'{"target": "a"}\x00',
            b"x" * (MAX_CONTROL_BODY + 1),
        ]
    ),
    hostile_text().map(lambda s: s.encode()),
)
QUERY = st.dictionaries(
    st.sampled_from(["dry_run", "all", "events", "lines", "errors", "x"]),
    st.one_of(st.sampled_from(["1", "0", "-1", "100000", "99999999999999999999"]), hostile_text()),
    max_size=3,
)
HEADER_TEXT = st.one_of(st.sampled_from(PLACEHOLDERS), hostile_text()).map(
    lambda s: re.sub(r"[\x00-\x1f\x7f]", "", s)  # what an HTTP field value cannot carry
)
# Every endpoint of the access table; those that act (serve, batches, stop, scale) more often;
# and some that are not endpoints.
ACTING_ROUTES = [("POST", "/v1/serve"), ("POST", "/v1/batches"), ("POST", "/v1/batch-inputs"),
                 ("POST", "/v1/stop"), ("POST", "/v1/scale"),
                 ("POST", "/v1/batches/{batch_id}/cancel")]  # fmt: skip
ROUTES = [(r.method, r.path) for r in authz.RULES] + 3 * ACTING_ROUTES + [
    ("GET", "/v1/no-such"), ("PUT", "/v1/serve"), ("DELETE", "/v1/deployments/{name}"),
    ("HEAD", "/v1/routes"), ("POST", "/v1/health"), ("GET", "/agent/v1/register"),
]  # fmt: skip
PARAM = re.compile(r"\{(\w+)\}")
HTTP_LINE_MAX = 8190  # aiohttp's longest request line or header line


@dataclass
class Request:
    method: str
    route: str  # the pattern it was drawn from
    path: str
    query: dict[str, str]
    body: bytes | None
    headers: dict[str, str]


@st.composite
def requests(draw: st.DrawFn) -> Request:
    method, pattern = draw(st.sampled_from(ROUTES))
    path = PARAM.sub(lambda m: quote(draw(anything()), safe=""), pattern)
    shaped = BODIES.get(pattern)
    body_kind = draw(st.sampled_from(["shaped", "shaped", "shaped", "json", "raw", "none"]))
    body: bytes | None
    if body_kind == "shaped" and shaped is not None:
        body = json.dumps(draw(shaped)).encode()
    elif body_kind == "json":
        body = json.dumps(draw(JSON)).encode()
    elif body_kind == "raw":
        body = draw(RAW_BODIES)
    else:
        body = None if method in ("GET", "HEAD") else b"{}"
    headers = {}
    if draw(st.integers(0, 3)) == 0:
        headers[ACTING_USER_HEADER] = draw(HEADER_TEXT)
    if draw(st.integers(0, 7)) == 0:
        headers[ACTING_KEY_HEADER] = draw(HEADER_TEXT)
    if draw(st.integers(0, 5)) == 0:
        headers["Content-Type"] = draw(
            st.sampled_from(["text/plain", "application/json; charset=bogus",
                             "application/json; charset=latin-1", "multipart/form-data"])
        )  # fmt: skip
    return Request(method, pattern, path, draw(QUERY), body, headers)


def raw_http(lab: Lab, req: Request) -> tuple[bytes, str, str | None]:
    """The request as bytes on the wire, its placeholders replaced by the real ids; the text
    the member named (path, query, headers, body), for the ids it may see echoed; its body."""

    def real(text: str) -> str:
        if "@FRESH_INPUT@" in text:
            text = text.replace("@FRESH_INPUT@", lab.fresh_input())
        if "@FRESH_NAME@" in text:
            lab.names += 1
            text = text.replace("@FRESH_NAME@", f"new{lab.names}")
        for placeholder, value in lab.ids.items():
            text = text.replace(placeholder, value)
            text = text.replace(quote(placeholder, safe=""), quote(value, safe=""))
        return text

    target = real(req.path) + ("?" + real(urlencode(req.query)) if req.query else "")
    body = None if req.body is None else real(req.body.decode("utf-8", "surrogateescape"))
    payload = b"" if body is None else body.encode("utf-8", "surrogateescape")
    lines = [f"{req.method} {target} HTTP/1.1", "Host: broker", "Connection: close"]
    if req.body is not None:
        lines.append(f"Content-Length: {len(payload)}")
        if "Content-Type" not in req.headers:
            lines.append("Content-Type: application/json")
    headers = {k: real(v) for k, v in req.headers.items()}
    lines += [f"{k}: {v}" for k, v in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    named = " ".join([target, *headers.values(), body or ""])
    return head + payload, named, body


def error_shape(body: str) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    err = data.get("error") if isinstance(data, dict) else None
    return (
        isinstance(err, dict)
        and isinstance(err.get("code"), str)
        and isinstance(err.get("message"), str)
    )


def shown_scripts(req: Request, status: int, body: str) -> list[str]:
    """The scripts a dry run answered with."""
    if status != 200 or not req.path.startswith("/v1/serve"):
        return []
    data = json.loads(body)
    scripts = data.get("scripts", {}) if isinstance(data, dict) else {}
    return [str(s) for s in scripts.values()]


JOB_BODIES = {
    "/v1/serve": shaped({"model": field_("@MODEL@"), "name": FRESH_NAME}, SERVE_FIELDS),
    "/v1/batches": BODIES["/v1/batches"],
}


@st.composite
def job_requests(draw: st.DrawFn) -> Request:
    """A serve (a dry run now and then) or a batch of the member's own: valid but for one or
    two fields; what reaches a job script."""
    route = draw(st.sampled_from(["/v1/serve", "/v1/batches"]))
    query = {"dry_run": "1"} if route == "/v1/serve" and draw(st.booleans()) else {}
    shaped_ = JOB_BODIES[route]
    return Request("POST", route, route, query, json.dumps(draw(shaped_)).encode(), {})


def exchange(lab: Lab, req: Request) -> None:
    """``req`` sent as the member, and everything that must hold of its answer and after it."""
    before = lab.owner_state()
    raw, named, sent = raw_http(lab, req)
    status, body = lab.call(req.method, raw)
    event(f"{req.method} {req.route}: {status}")
    what = f"{req.method} {req.path[:200]} -> {status} {body[:300]}"
    assert 0 < status < 500, what
    if max(len(line) for line in raw.split(b"\r\n\r\n")[0].split(b"\r\n")) > HTTP_LINE_MAX:
        # Refused by aiohttp's HTTP parser before any handler, in its own plain text.
        assert status in (400, 431), what
    elif status >= 400 and req.method != "HEAD":
        assert error_shape(body), what
    for secret in lab.secrets:
        assert secret not in body, f"{what}: a secret of the owner's"
    lab.named.update(owned for owned in lab.owner_ids if owned in named)
    for owned in lab.owner_ids:
        assert owned not in body or owned in lab.named, f"{what}: the owner's {owned}"
    assert lab.owner_state() == before, what
    scripts = [*lab.slurm.scripts[lab.checked_scripts :], *shown_scripts(req, status, body)]
    lab.checked_scripts = len(lab.slurm.scripts)
    event(f"scripts written or shown: {min(len(scripts), 2)}+")
    for script in scripts:
        assert directive_problems(script) == [], f"{what}\n{script}"
        assert_values_as_sent(script, sent)
    lab.stop_member_s_new()


def assert_values_as_sent(script: str, sent: str | None) -> None:
    """The partition, QoS and time limit a job's request named stand on its lines as sent."""
    try:
        asked = json.loads(sent or "")
    except ValueError:
        return
    if not isinstance(asked, dict):
        return
    lines = options(script)
    for option in ("partition", "qos", "time"):
        if isinstance(asked.get(option), str):
            assert lines.get(f"--{option}") == asked[option], f"--{option} in\n{script}"


@given(req=requests())
@PROPS
def test_another_member_gets_no_5xx_no_secret_and_changes_nothing_of_the_owner_s(
    lab: Lab, req: Request
) -> None:
    exchange(lab, req)


@given(req=job_requests())
@settings(PROPS, max_examples=120)
def test_a_member_s_jobs_carry_only_allowed_values_on_their_sbatch_lines(
    lab: Lab, req: Request
) -> None:
    exchange(lab, req)
