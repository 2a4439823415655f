"""Jobs belong to the member who asked (decision 0014), on the real dev cluster.

A lab member (the system user ``xhpc-member``, in Slurm account lab2 only: scripts/dev-accounting)
runs their own broker. Its job runs in Slurm under the member's user and account; a model path
the member cannot read is refused. The lab's gateway (root's proxy, reading root's broker and
the member's: ``[proxy] brokers``) serves the member's model to the member's key, and to no
one else's."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    ROOT,
    SLURM_CONF,
    SYSTEM_PYTHON,
    Xhpc,
    _start_xhpc,
    _teardown_xhpc,
    as_uid,
    slurm_env,
    wait_for,
    xhpc_as,
)

pytestmark = [pytest.mark.cluster, pytest.mark.security]

MEMBER = "xhpc-member"  # scripts/dev-accounting: a system user, associated with lab2 only
ECHO = ROOT / "tests" / "data" / "engines" / "echo_engine.py"  # stdlib only

MEMBER_SITE = """\
site = "dev-cluster"
cpu_only = true
default_engine = "command"

[slurm]
conf_path = "{slurm_conf}"
partition = "gpu"
default_time = "00:30:00"
command_timeout_s = 20

[broker]
agent_bind = "10.77.0.1"
reconcile_interval_s = 0.5
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 15

[engines.command]
command = ["{python}", "{echo}", "--port", "{{port}}", "--served-model", "{{served_model}}"]
startup_timeout_s = 60
"""


@dataclass
class Member:
    """A member's own broker, run as their Unix user, with a state directory of theirs."""

    uid: int
    state_dir: Path
    env: dict[str, str]
    argv: list[str]
    broker: subprocess.Popen[bytes]

    @property
    def socket(self) -> Path:
        return self.state_dir / "broker.sock"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*as_uid(self.uid), *self.argv, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )


@pytest.fixture
def member(dev_cluster: Path, tiny_model: Path) -> Iterator[Member]:
    uid = pwd.getpwnam(MEMBER).pw_uid
    state = Path(tempfile.mkdtemp(prefix="xt-member-", dir="/tmp"))
    models = state / "models"
    shutil.copytree(tiny_model, models / "tiny-llama")
    shutil.copy(ECHO, state / "echo_engine.py")
    (state / "site.toml").write_text(
        MEMBER_SITE.format(
            slurm_conf=SLURM_CONF, python=SYSTEM_PYTHON, echo=state / "echo_engine.py"
        )
    )
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(state)], check=True)
    state.chmod(0o700)
    argv, extra = xhpc_as(uid)  # its jobs run the agent with its Python
    env = {
        **extra,  # the installed xhpc's; the member's own site file below wins
        "HOME": str(state),
        "PATH": os.environ["PATH"],
        "SLURM_CONF": str(SLURM_CONF),
        "XHPC_SITE_CONFIG": str(state / "site.toml"),
        "XHPC_STATE_DIR": str(state),
        "XHPC_MODELS_DIR": str(models),
    }
    log = (state / "member-broker.log").open("wb")
    broker = subprocess.Popen(
        [*as_uid(uid), *argv, "broker"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    m = Member(uid, state, env, argv, broker)
    try:
        wait_for(lambda: m.socket.exists() or broker.poll() is not None, 30, "the member's broker")
        assert broker.poll() is None, (state / "member-broker.log").read_text()[-2000:]
        yield m
    finally:
        broker.terminate()
        try:
            broker.wait(40)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()
        log.close()
        jobs = _jobs_of(MEMBER)
        if jobs:
            subprocess.run(["scancel", *jobs], env=slurm_env(), check=False)
            wait_for(lambda: not _jobs_of(MEMBER), 60, "the member's jobs to leave squeue")
        keep = os.environ.get("XHPC_TEST_KEEP_LOGS")  # a directory: the member's state too
        if keep:
            shutil.copytree(state, Path(keep) / state.name, dirs_exist_ok=True)
        shutil.rmtree(state, ignore_errors=True)


def _jobs_of(user: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-u", user, "-o", "%i"],
        env=slurm_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.split()


@pytest.fixture
def gateway(member: Member, tiny_model: Path) -> Iterator[Xhpc]:
    """Root's broker, and the lab gateway reading it and the member's broker."""
    toml = f'[proxy]\nauth = "keys"\nbrokers = ["@STATE@/broker.sock", "{member.socket}"]\n'
    x = _start_xhpc(tiny_model, toml)
    try:
        yield x
    finally:
        _teardown_xhpc(x)


def _chat(x: Xhpc, model: str, key: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", x.proxy_port, timeout=30)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _key(x: Xhpc, user: str, account: str) -> str:
    made = json.loads(
        x.run("keys", "create", "--user", user, "--account", account, "--json").stdout
    )
    return str(made["key"])


def test_a_members_job_is_theirs_and_the_lab_gateway_serves_it_to_them(
    member: Member, gateway: Xhpc, unique_name: str
) -> None:
    name = unique_name
    served = member.run("serve", "tiny-llama", "--name", name, "--timeout", "120", "--json")
    assert served.returncode == 0, served.stderr
    (replica,) = json.loads(served.stdout)["replicas"]
    assert replica["state"] == "READY"
    # Slurm sees the member, with the member's own account: its limits and accounting apply.
    row = subprocess.run(
        ["squeue", "-h", "-j", str(replica["job_id"]), "-o", "%u|%a"],
        env=slurm_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert row == [f"{MEMBER}|lab2"]
    # The gateway serves it to the member's key, as the member's model.
    mine, other = _key(gateway, MEMBER, "lab2"), _key(gateway, "root", "lab1")

    def answered() -> bool:
        return _chat(gateway, name, mine)[0] == 200

    wait_for(answered, 30, "the gateway to route the member's model")
    for _ in range(3):
        status, body = _chat(gateway, name, mine)
        assert status == 200, body
        assert body["model"] == name and body["choices"][0]["message"]["content"]
    # `keys create` returned once every proxy worker had the key: it is known at once.
    status, body = _chat(gateway, name, other)
    assert status == 404, body  # another member's key: as if it did not exist
    assert body["error"]["code"] == "model_not_found"
    # It stops as the member's.
    stopped = member.run("stop", name)
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not _jobs_of(MEMBER), 60, "the member's job to end")


def test_a_member_cannot_serve_a_model_only_root_may_read(member: Member) -> None:
    secret = Path(tempfile.mkdtemp(prefix="xt-root-only-", dir="/tmp"))
    try:
        shutil.copytree(member.state_dir / "models" / "tiny-llama", secret / "m")
        secret.chmod(0o700)
        refused = member.run("serve", str(secret / "m"), "--name", "root-only", "--json")
        assert refused.returncode != 0
        (line,) = refused.stderr.strip().splitlines()
        assert json.loads(refused.stdout)["error"]["message"] in line  # --json: the error as JSON
        assert _jobs_of(MEMBER) == []
    finally:
        shutil.rmtree(secret, ignore_errors=True)
