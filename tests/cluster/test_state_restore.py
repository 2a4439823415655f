"""A broker's state restored from a backup on the dev cluster (the command engine's echo
server): the login node is lost with a deployment serving (its broker and gateway killed, its
database and broker id gone); `xhpc state restore` of the backup on a fresh login node (the dev
cluster's second, `scripts/dev-cluster login2`: another host name and address) and a broker and
a gateway started there serve the same deployment from the same job, relaunching nothing (its
agent finds the new broker's address in broker.json), and the new gateway answers for it; a job
the backup does not know (served after it) is not adopted."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cluster.test_chaos import replicas
from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import DEV_CLUSTER, XHPC, Xhpc, own_xhpc, wait_for

pytestmark = pytest.mark.cluster


LOGIN2 = "10.77.0.2"


def _answer(x: Xhpc, model: str) -> str:
    conn = http.client.HTTPConnection(LOGIN2, x.proxy_port, timeout=30)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"null")
        return str(data["choices"][0]["message"]["content"]) if resp.status == 200 else ""
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return ""
    finally:
        conn.close()


def test_a_restored_state_serves_the_same_jobs_and_relaunches_nothing(
    dev_cluster: Path, tiny_model: Path, unique_name: str, tmp_path: Path
) -> None:
    kept, later = unique_name, f"{unique_name}b"
    with own_xhpc(tiny_model, ECHO_ENGINE) as x:
        serve = ("serve", "tiny-llama", "--engine", "command", "--timeout", "120")
        x.run(*serve, "--name", kept)
        (before,) = replicas(x, kept)
        archive = tmp_path / "state.tar.gz"
        made = x.run("state", "backup", str(archive))
        assert "1 deployment(s), 1 active replica(s)" in made.stdout
        x.run(*serve, "--name", later)  # after the backup: not in it
        (late,) = replicas(x, later)

        # The login node is lost: its broker and gateway gone, its database and broker id too.
        for proc in list(x.procs):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            x.procs.remove(proc)
        lost = tmp_path / "lost"
        lost.mkdir()
        for f in x.state_dir.glob("xhpc.db*"):
            shutil.move(str(f), lost / f.name)
        shutil.move(str(x.state_dir / "broker-id"), lost / "broker-id")

        # A fresh login node: restore there, and start its broker and gateway.
        fresh = tmp_path / "login2.toml"  # the user file, with this login node's addresses
        fresh.write_text(ECHO_ENGINE + f'\n[broker]\nagent_bind = "{LOGIN2}"\n\n'
                         f'[proxy]\nhost = "{LOGIN2}"\n')  # fmt: skip
        env = {**x.env, "XHPC_USER_CONFIG": str(fresh)}
        on_login2 = [str(DEV_CLUSTER), "login2", XHPC]
        done = subprocess.run([*on_login2, "state", "restore", str(archive)], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"restored {archive}: broker ")
        for what in ("broker", "proxy"):
            log = (x.state_dir / f"{what}-login2.log").open("ab")
            x.procs.append(subprocess.Popen([*on_login2, what], env=env, stdout=log, stderr=log))
        wait_for(lambda: x.run("ps", check=False).returncode == 0, 60, "the broker back")
        found = json.loads((x.state_dir / "broker.json").read_text())
        assert found["agent_url"].startswith(f"http://{LOGIN2}:")  # jobs find it there

        # The same replica, the same job, READY; the gateway answers for it.
        def same() -> bool:
            rows = replicas(x, kept)
            return [(r["replica_id"], r["job_id"], r["state"]) for r in rows] == [
                (before["replica_id"], before["job_id"], "READY")
            ]

        wait_for(same, 90, "the backup's replica READY on its own job")
        wait_for(lambda: _answer(x, kept).startswith("gpus="), 60, "an answer through the gateway")
        # The deployment served after the backup is unknown to the restored broker: its job is
        # not adopted (the sweep cancels a job of this broker's tag that it does not know).
        wait_for(lambda: str(late["job_id"]) not in x.my_jobs(), 120, "the unknown job gone")
        assert later not in {r["deployment"] for r in json.loads(x.run("ps", "--json").stdout)}
        x.run("stop", kept)
        x.wait_no_jobs(120)
