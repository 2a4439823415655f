"""Remote use against a login node inside the dev cluster: a network namespace of the test's
own on the cluster's bridge (tests/sshd.py's ``login_namespace``, beside the compute nodes
n1..n3) runs a real OpenSSH server on port 22 of its address, for a Unix user of its own.

The test's broker (a lab broker: every local user reaches its socket) and proxy run on the
bridge's host side, 10.77.0.1, which the login namespace reaches; the login node's xhpc finds
them through what the site's setup exports (XHPC_STATE_DIR, XHPC_PROXY_HOST, ...). This
machine's own namespace plays the laptop: `xhpc --remote USER@ADDRESS` lists the replica the
test served, passes a refused request's exit code and one error line through, and `tunnel`
carries the openai SDK to the proxy and the served model."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, own_xhpc, readable_models_dir, readable_site_config, wait_for
from tests.sshd import (
    LoginNamespace,
    Sshd,
    interrupt_tunnel,
    login_namespace,
    needs_sshd,
    running_sshd,
)

pytestmark = [needs_sshd, pytest.mark.cluster, pytest.mark.ssh]

BRIDGE, HOST_SIDE = "xhpcbr0", "10.77.0.1"  # scripts/dev-cluster's bridge and its address
LOGIN_OCTETS = range(240, 255)  # above every compute node's 10.77.0.(10+K), K <= 200

LAB = (
    ECHO_ENGINE
    + f"""
[broker]
shared_socket = true

[proxy]
host = "{HOST_SIDE}"
"""
)


@dataclass
class Lab:
    x: Xhpc
    login: LoginNamespace
    sshd: Sshd
    name: str  # the served deployment


@pytest.fixture(scope="module")
def lab(dev_cluster: Path, tiny_model: Path) -> Iterator[Lab]:
    name = f"t{uuid.uuid4().hex[:8]}"
    with own_xhpc(tiny_model, LAB) as x:
        x.run(
            "serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90",
            "--json",
        )  # fmt: skip
        # What the login node's setup exports for xhpc (a site's module file would).
        login_env = {
            k: v for k, v in x.env.items() if k.startswith("XHPC_") and k != "XHPC_USER_CONFIG"
        }
        login_env["XHPC_PROXY_HOST"] = HOST_SIDE
        login_env["XHPC_SITE_CONFIG"] = str(readable_site_config())  # not the checkout's copy
        login_env["XHPC_MODELS_DIR"] = str(readable_models_dir(tiny_model))
        with (
            login_namespace(BRIDGE, "10.77.0", LOGIN_OCTETS) as login,
            running_sshd(netns=login.name, address=login.address, login_env=login_env) as sshd,
        ):
            yield Lab(x=x, login=login, sshd=sshd, name=name)


@pytest.fixture
def lab_xhpc(lab: Lab) -> Xhpc:
    """The lab's broker and proxy, as a test's argument: a failed test shows their logs."""
    return lab.x


def laptop(sshd: Sshd, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*sshd.remote_argv(*args)],
        env=sshd.laptop_env(),
        capture_output=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_ps_over_ssh_lists_the_replica_served_on_the_lab(lab: Lab, lab_xhpc: Xhpc) -> None:
    assert lab.sshd.destination == f"{lab.sshd.user}@{lab.login.address}"  # port 22
    done = laptop(lab.sshd, "ps", "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    mine = [r for r in rows if r["deployment"] == lab.name]
    assert [(r["replica_id"], r["state"]) for r in mine] == [(f"{lab.name}-0", "READY")]
    # The session came from the laptop's side of the bridge into the login namespace.
    assert f"from {HOST_SIDE}" in (lab.sshd.dir / "sshd.log").read_text()


def test_a_refused_serve_exits_non_zero_with_one_error_line(lab: Lab, lab_xhpc: Xhpc) -> None:
    jobs = lab.x.my_jobs()
    args = ("serve", "tiny-llama", "--gpus", "5", "--detach")
    done = laptop(lab.sshd, *args)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == b""
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "more than any node has (largest: 4 GPUs)" in lines[0]
    # The same as typed on the login node, and nothing was submitted.
    here = lab.sshd.login_node_run(*args)
    assert (here.returncode, here.stdout, here.stderr) == (2, b"", done.stderr)
    assert lab.x.my_jobs() == jobs


def test_a_tunnel_carries_the_openai_sdk_to_the_served_model(lab: Lab, lab_xhpc: Xhpc) -> None:
    argv = lab.sshd.remote_argv("tunnel", "--port", "0", "--json")
    proc = subprocess.Popen(
        argv, env=lab.sshd.laptop_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline() or b"null")
        assert info is not None, proc.stderr.read() if proc.stderr else ""
        assert info["to"] == f"{HOST_SIDE}:{lab.x.proxy_port}"
        assert info["url"] == f"http://127.0.0.1:{info['local_port']}/v1"
        assert info["local_port"] != lab.x.proxy_port
        client = openai.OpenAI(base_url=info["url"], api_key="unused", max_retries=0, timeout=20)

        def answer() -> str:
            try:
                reply = client.chat.completions.create(
                    model=lab.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            except openai.APIError:
                return ""
            return reply.choices[0].message.content or ""

        content = wait_for(answer, 30, "the served model to answer through the tunnel")
        assert str(content).startswith("gpus="), content
        assert lab.name in [m.id for m in client.models.list().data]
    finally:
        code = interrupt_tunnel(proc)
    assert code == 0
