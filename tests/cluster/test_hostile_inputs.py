"""A table of hostile values tried in every field of every entry point, as a second Unix user.

A lab broker (``shared_socket``: every local user reaches it) runs on the dev cluster; the other
user runs the installed wheel. Each hostile value goes into each field of the CLI's commands,
the control socket's endpoints (raw HTTP over the Unix socket) and the Python API. Every answer
must be a refusal: the CLI one ``error:`` line and a non-zero exit, the control API a 4xx with
its error object, the Python API an ``XhpcError``; never a traceback or a 5xx. Afterwards no job
was submitted and the broker still answers.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc, as_uid, xhpc_as

pytestmark = [pytest.mark.cluster, pytest.mark.adversarial, pytest.mark.security]

OTHER_UID = 4245  # a uid with no account, no home
# Quotes, backslashes, newlines, '#', leading '--', non-ASCII, 10,000 characters, '..', URL
# escapes, and the #SBATCH break-out of the review. NUL cannot be in argv: it goes to the
# control API and the Python API only.
HOSTILE = [
    "a'b", 'a"b', "a\\b", "x\\'' --qos=high --export=ALL #", "a\nb", "#x", "--export=ALL",
    "ünï€", "x" * 10_000, "../..", "..%2F..%2Fkeys%2Fx%2Frevoke%3F", "a%3Fowner=root", "a b",
]  # fmt: skip
WITH_NUL = [*HOSTILE, "a\x00b"]
# One plain word is a legitimate engine argument (it reaches the engine as one argv word, never
# a shell or Slurm): not a hostile value there.
ENGINE_WORD = re.compile(r"[A-Za-z0-9._+=:,/@%-]{1,256}")

# argv templates: H is the hostile value.
CLI = [
    ["serve", "H"],
    ["serve", "tiny-llama", "--name", "H"],
    ["serve", "tiny-llama", "--partition", "H"],
    ["serve", "tiny-llama", "--time", "H"],
    ["serve", "tiny-llama", "--for", "H"],
    ["serve", "tiny-llama", "--nodelist", "H"],
    ["serve", "tiny-llama", "--gpu-type", "H"],
    ["serve", "tiny-llama", "--pilot", "H"],
    ["serve", "tiny-llama", "--engine-arg", "H"],
    ["serve", "tiny-llama", "--replica-config", "H"],
    ["serve", "tiny-llama", "--engine-config", "H"],
    ["serve", "tiny-llama", "--engine-config", '{"tool_call_parser": "@JSON"}'],
    ["serve", "tiny-llama", "--engine-config", '{"chat_template": "@JSON"}'],
    ["serve", "tiny-llama", "--pd", "1P1D", "--prefill-nodes", "H"],
    ["scale", "H", "2"],
    ["stop", "H"],
    ["logs", "H"],
    ["batch", "submit", "@INPUT", "--model", "H"],
    ["batch", "submit", "@INPUT", "--model", "tiny-llama", "--partition", "H"],
    ["batch", "submit", "@INPUT", "--model", "tiny-llama", "--qos", "H"],
    ["batch", "submit", "@INPUT", "--model", "tiny-llama", "--time", "H"],
    ["batch", "submit", "@INPUT", "--model", "tiny-llama", "--engine", "H"],
    ["batch", "status", "H"],
    ["batch", "results", "H"],
    ["batch", "cancel", "H"],
    ["cache", "pull", "H", "--from", "/tmp"],
    ["cache", "pull", "tiny-llama", "--from", "H"],
    ["keys", "revoke", "H"],
    ["adapters", "add", "H", "--base", "tiny-llama", "--path", "/tmp"],
    ["adapters", "add", "a1", "--base", "H", "--path", "/tmp"],
    ["adapters", "add", "a1", "--base", "tiny-llama", "--path", "H"],
    ["adapters", "rm", "H"],
    ["serve", "tiny-llama", "--max", "H"],
    ["serve", "tiny-llama", "--max", "2", "--idle", "H"],
    ["serve", "tiny-llama", "--max", "2", "--target-inflight", "H"],
    ["serve", "tiny-llama", "--max", "2", "--down-window", "H"],
    ["scale", "H", "--max", "2"],
    ["scale", "tiny-llama", "--max", "H"],
    ["scale", "tiny-llama", "--idle", "H"],
]

# Run as the other user with the wheel's Python: the control socket and the Python API.
PROBE = r"""
import http.client, json, re, socket, sys
sock_path, values = sys.argv[1], json.loads(sys.stdin.read())

class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(sock_path)

def call(method, path, body=None):
    c = Conn("broker")
    try:
        c.request(method, path, body=None if body is None else json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    except (http.client.InvalidURL, ValueError, UnicodeEncodeError) as err:
        return 0, repr(err).encode()  # refused by the client library before it was sent
    finally:
        c.close()

from urllib.parse import quote
out = []
serve_fields = ["model", "name", "partition", "time", "run_for", "nodelist", "gpu_type", "pilot"]
for v in values:
    for f in serve_fields:
        body = {"model": "tiny-llama", f: v}
        out.append(("POST /v1/serve " + f, *call("POST", "/v1/serve", body)))
    for f in ["tool_call_parser", "reasoning_parser", "chat_template", "quantization"]:
        body = {"model": "tiny-llama", "engine": "vllm", "engine_config": {f: v}}
        out.append(("POST /v1/serve engine_config." + f, *call("POST", "/v1/serve", body)))
    out.append(("POST /v1/serve engine_config", *call("POST", "/v1/serve",
                {"model": "tiny-llama", "engine_config": v})))
    if not re.fullmatch(r"[A-Za-z0-9._+=:,/@%-]{1,256}", v):  # one plain word is an argument
        out.append(("POST /v1/serve engine_args", *call("POST", "/v1/serve",
                    {"model": "tiny-llama", "engine_args": [v]})))
    for f in ["model", "partition", "qos", "time", "engine", "endpoint"]:
        body = {"model": "tiny-llama", "input": "{}\n", f: v}
        out.append(("POST /v1/batches " + f, *call("POST", "/v1/batches", body)))
    out.append(("POST /v1/stop", *call("POST", "/v1/stop", {"name": v})))
    out.append(("POST /v1/scale", *call("POST", "/v1/scale", {"name": v, "replicas": 2})))
    q = quote(v, safe="")
    for path in (f"/v1/batches/{q}", f"/v1/batches/{q}/output", f"/v1/deployments/{q}",
                 f"/v1/replicas/{q}/logs", f"/v1/cache/pulls/{q}"):
        out.append(("GET " + path[:40], *call("GET", path)))
    out.append(("POST cancel", *call("POST", f"/v1/batches/{q}/cancel", {})))
    out.append(("POST revoke", *call("POST", f"/v1/keys/{q}/revoke", {})))
    for f in ["min_replicas", "max_replicas", "target_in_flight", "ttft_s", "idle_s",
              "down_window_s"]:
        body = {"model": "tiny-llama", "scaling": {"max_replicas": 2, f: v}}
        out.append(("POST /v1/serve scaling." + f, *call("POST", "/v1/serve", body)))
        out.append(("POST scaling " + f, *call("POST", "/v1/deployments/tiny-llama/scaling",
                                               {f: v})))
    out.append(("POST scaling of", *call("POST", f"/v1/deployments/{q}/scaling",
                                         {"max_replicas": 2})))
    for f in ["name", "base", "path"]:
        body = {"name": "a1", "base": "tiny-llama", "path": "/tmp", f: v}
        out.append(("POST /v1/adapters " + f, *call("POST", "/v1/adapters", body)))
    out.append(("POST adapter rm", *call("POST", f"/v1/adapters/{q}/rm", {})))

import xhpc
from xhpc.errors import XhpcError
api = []
for v in values:
    for kwargs in ({"model": v}, {"model": "tiny-llama", "name": v},
                   {"model": "tiny-llama", "partition": v}, {"model": "tiny-llama", "time": v}):
        try:
            with xhpc.serve(timeout_s=20, **kwargs):
                api.append(("serve", repr(kwargs)[:60], "ADMITTED"))
        except XhpcError as err:
            api.append(("serve", repr(kwargs)[:60], "refused"))
        except Exception as err:
            api.append(("serve", repr(kwargs)[:60], f"{type(err).__name__}: {err}"[:200]))
    try:
        xhpc.connect(v)
        api.append(("connect", repr(v)[:60], "ADMITTED"))
    except XhpcError:
        api.append(("connect", repr(v)[:60], "refused"))
    except Exception as err:
        api.append(("connect", repr(v)[:60], f"{type(err).__name__}: {err}"[:200]))
def shape(body):
    try:
        error = json.loads(body).get("error", {})
    except ValueError:
        return False
    return bool(error.get("message") and error.get("code"))

print(json.dumps({"http": [(w, s, shape(b), b.decode(errors="replace")[:200]) for w, s, b in out],
                  "api": api}))
"""

# The CLI, run in one process of the other user (its import paid once): argv in, for each the
# exit status and what went to stderr, as `xhpc ARGV` would end.
CLI_PROBE = r"""
import contextlib, io, json, sys
from xhpc.cli.main import main
out = []
for argv in json.loads(sys.stdin.read()):
    err, std = io.StringIO(), io.StringIO()
    sys.argv = ["xhpc", *argv]
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:
            code = -1
            err.write(f"Traceback: {type(e).__name__}: {e}")
    out.append((argv, code, err.getvalue()))
print(json.dumps(out))
"""


# The gateway's doors, run as the other user against the lab's proxy (keys off on the dev
# cluster: the caller is the proxy's own user, the most trusted a gateway call can be).
GATEWAY_PROBE = r"""
import http.client, json, sys, uuid
from urllib.parse import quote
port, values = int(sys.argv[1]), json.loads(sys.stdin.read())

def call(method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    except (http.client.InvalidURL, ValueError, UnicodeEncodeError) as err:
        return 0, repr(err).encode()
    finally:
        c.close()

def js(method, path, obj):
    return call(method, path, json.dumps(obj).encode(), {"Content-Type": "application/json"})

def upload(filename, purpose, content):
    b = uuid.uuid4().hex
    parts = [f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n',
             f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
             f"Content-Type: application/jsonl\r\n\r\n"]
    body = "".join(parts).encode("utf-8", "surrogateescape") + content + f"\r\n--{b}--\r\n".encode()
    return call("POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={b}"})

out = []
for v in values:
    q = quote(v, safe="")
    msg = [{"role": "user", "content": "hi"}]
    out.append(("chat model", *js("POST", "/v1/chat/completions", {"model": v, "messages": msg})))
    for path in ("/v1/responses", "/tokenize", "/detokenize", "/v1/rerank", "/score"):
        body = {"model": v, "input": v, "prompt": v, "query": v, "documents": [v], "tokens": [1]}
        out.append((path + " model", *js("POST", path, body)))
    out.append(("batch create", *js("POST", "/v1/batches", {"input_file_id": v,
               "endpoint": "/v1/chat/completions", "completion_window": "24h"})))
    for path in (f"/v1/batches/{q}", f"/v1/files/{q}", f"/v1/files/{q}/content"):
        out.append(("GET " + path[:30], *call("GET", path)))
    out.append(("cancel", *js("POST", f"/v1/batches/{q}/cancel", {})))
    out.append(("delete file", *call("DELETE", f"/v1/files/{q}")))
    out.append(("upload purpose", *upload("in.jsonl", v[:200], b'{"a": 1}\n')))
    good = b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    status, body = upload(v[:300], "batch", good)
    if status == 200:  # a name it kept: shown back as data, never as a path
        obj = json.loads(body)
        ok = "/" not in obj["filename"] and "\n" not in obj["filename"]
        call("DELETE", f"/v1/files/{obj['id']}")
        status, body = (200, b'{"error": {"message": "kept", "code": "kept"}}') if ok else (
            599, body)
    out.append(("upload filename", status, body))
    raw = v.encode("utf-8", "surrogateescape")
    out.append(("upload content", *upload("in.jsonl", "batch", raw)))
line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "tiny-llama", "messages": []}}).encode() + b"\n"
status, body = upload("in.jsonl", "batch", line)
fid = json.loads(body)["id"] if status == 200 else None
for v in values:
    if fid is None:
        break
    for key in ("xhpc_partition", "xhpc_qos", "xhpc_time", "xhpc_engine", "xhpc_shards",
                "xhpc_gpus"):
        out.append(("batch " + key, *js("POST", "/v1/batches", {"input_file_id": fid,
                   "endpoint": "/v1/chat/completions", "metadata": {key: v}})))

def shape(body):
    try:
        error = json.loads(body).get("error", {})
    except ValueError:
        return False
    return bool(error.get("message") and error.get("code"))

print(json.dumps({"uploaded": status, "http": [(w, s, shape(b), b.decode(errors="replace")[:200])
                                               for w, s, b in out]}))
"""


def _not_refused(rows: list[list[Any]]) -> list[str]:
    """The answers (what, status, has an error object, body) that are not a refusal: a 4xx
    with the error object. A request the client would not send (status 0: a NUL or a line break
    in the URL) or the HTTP parser refused (a request line past its limit) is refused too."""
    bad = []
    for what, status, shaped, body in rows:
        if status == 0 or (status == 400 and body.startswith("Got more than 8190 bytes")):
            continue
        if not 400 <= status < 500:
            bad.append(f"{what}: {status} {body}")
        elif not shaped:
            bad.append(f"{what}: {status} without an error object: {body}")
    return bad


@pytest.fixture(scope="module")
def lab(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE + "\n[broker]\nshared_socket = true\n")
    yield x
    _teardown_xhpc(x)


def _as_other(
    x: Xhpc, argv: list[str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    _, extra = xhpc_as(OTHER_UID)
    env = {k: v for k, v in x.env.items() if k.startswith(("XHPC_", "SLURM"))}
    env.update(HOME="/tmp", PATH="/usr/bin:/bin", **extra)
    env["XHPC_SITE_CONFIG"] = extra["XHPC_SITE_CONFIG"]
    return subprocess.run([*as_uid(OTHER_UID), *argv], env=env, input=stdin,
                          capture_output=True, text=True, timeout=600, cwd="/tmp")  # fmt: skip


def _in_json(arg: str, value: str) -> str:
    """``arg`` with the hostile value as a JSON string where it says ``@JSON``."""
    return arg.replace('"@JSON"', json.dumps(value)) if "@JSON" in arg else arg


def test_every_cli_field_refuses_hostile_values_in_one_line(lab: Xhpc, tmp_path: Path) -> None:
    cli, _ = xhpc_as(OTHER_UID)
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                        '"body": {"model": "tiny-llama", "messages": []}}\n')  # fmt: skip
    tmp_path.chmod(0o755)
    requests.chmod(0o644)
    before = lab.my_jobs()
    argvs = [
        [
            str(requests) if a == "@INPUT" else value if a == "H" else _in_json(a, value)
            for a in template
        ]
        for template in CLI
        for value in HOSTILE
        if not ("--engine-arg" in template and ENGINE_WORD.fullmatch(value))
    ]
    python = cli[0].replace("/bin/xhpc", "/bin/python")
    done = _as_other(lab, [python, "-c", CLI_PROBE], stdin=json.dumps(argvs))
    assert done.returncode == 0, done.stderr[-3000:]
    ended = json.loads(done.stdout)
    assert len(ended) == len(argvs)
    bad: list[str] = []
    for argv, code, err in ended:
        lines = err.strip().splitlines()
        if code in (0, -1) or len(lines) != 1 or not lines[0].startswith("error:"):
            bad.append(f"{[a[:40] for a in argv]}: exit {code}, {err[-300:]!r}")
    assert bad == [], "\n".join(bad[:20])
    assert lab.my_jobs() == before  # nothing was submitted
    assert json.loads(lab.run("ps", "--json").stdout) == []


def test_the_control_socket_and_python_api_refuse_hostile_values(lab: Xhpc) -> None:
    cli, _ = xhpc_as(OTHER_UID)
    python = cli[0].replace("/bin/xhpc", "/bin/python")
    before = lab.my_jobs()
    done = _as_other(lab, [python, "-c", PROBE, str(lab.state_dir / "broker.sock")],
                     stdin=json.dumps(WITH_NUL))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    bad = _not_refused(seen["http"])
    bad += [" ".join(row) for row in seen["api"] if row[2] != "refused"]
    assert bad == [], "\n".join(bad[:30])
    assert lab.my_jobs() == before
    assert lab.run("ps", "--json").returncode == 0


def test_the_gateway_refuses_hostile_values_in_every_door(lab: Xhpc) -> None:
    cli, _ = xhpc_as(OTHER_UID)
    python = cli[0].replace("/bin/xhpc", "/bin/python")
    before = lab.my_jobs()
    done = _as_other(lab, [python, "-c", GATEWAY_PROBE, str(lab.proxy_port)],
                     stdin=json.dumps(WITH_NUL))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["uploaded"] == 200  # a good file: its batch's metadata is what is tried
    rows = seen["http"]  # a name kept as the file's name holds no '/' or line break
    bad = _not_refused([r for r in rows if not (r[0] == "upload filename" and r[1] == 200)])
    assert bad == [], "\n".join(bad[:30])
    assert lab.my_jobs() == before
