"""docs/operators.md, run as written on the dev cluster: the wheel installed into a fresh
environment, a gateway user with TLS, two members each with their own broker, a key, one member
serving the tiny model (the transformers engine), the other calling it through the gateway and
running a batch.

The commands come from the document itself (its blocks tagged ``run-as=``), so the two cannot
drift apart. The test supplies only the names of the settings block (paths under a directory of
its own, the dev cluster's users: scripts/dev-accounting) and a user config with what differs on
the dev cluster (CPU engines and their environment, the Slurm config's path, the bridge's
address), as a site's environment module would.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT, SLURM_CONF, free_port, needs_other_users, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, needs_other_users]

GUIDE = ROOT / "docs" / "operators.md"
ROLES = {"root": "root", "gateway": "xhpc-gw", "member-a": "xhpc-member",
         "member-b": "xhpc-member2"}  # fmt: skip
# The transformers engine in an environment every user can run (scripts/test makes it).
SHARED_ENGINES = Path(os.environ.get("XHPC_TEST_SHARED_ENGINES", "/tmp/xhpc-test-engines"))
KEY_RE = re.compile(r"xhpc-[0-9a-f]{12}\.[A-Za-z0-9_-]{20,100}")
FENCE = re.compile(r"^( *)```bash (.+)$")

DEV_OVERLAY = """\
cpu_only = true
default_engine = "transformers"

[slurm]
conf_path = "{slurm_conf}"
default_time = "00:30:00"
command_timeout_s = 20

[broker]
agent_bind = "10.77.0.1"
reconcile_interval_s = 0.5
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 15

[engines.transformers]
python = "{python}"
startup_timeout_s = 180
"""


@dataclass
class Block:
    tags: list[str]
    text: str

    def tag(self, name: str) -> str | None:
        for t in self.tags:
            key, _, value = t.partition("=")
            if key == name:
                return value or key
        return None


def guide_blocks(text: str) -> list[Block]:
    """The document's ```bash blocks with tags (``settings``, ``run-as=ROLE`` ...), in order,
    their list indentation removed."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        i += 1
        if not m:
            continue
        indent, body = len(m.group(1)), []
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i].strip() else "")
            i += 1
        blocks.append(Block(m.group(2).split(), "\n".join(body) + "\n"))
    return blocks


def test_the_guide_has_the_blocks_this_test_runs() -> None:
    blocks = guide_blocks(GUIDE.read_text())
    assert [b for b in blocks if b.tag("settings")], "no settings block"
    roles = [b.tag("run-as") for b in blocks if b.tag("run-as")]
    assert set(roles) == set(ROLES), roles
    text = " ".join(b.text for b in blocks)
    steps = (
        'bin/pip" install',
        "openssl req",
        "xhpc config check",
        "xhpc broker",
        "xhpc proxy",
        "xhpc keys create",
        "xhpc serve",
        "curl",
        "xhpc batch submit",
    )
    for step in steps:
        assert step in text, f"the guide's blocks no longer run {step!r}"


@dataclass
class Site:
    base: Path
    env: dict[str, str]
    settings: str
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def argv(self, role: str, script: str) -> list[str]:
        user = ROLES[role]
        prefix = [] if user == "root" else [
            "setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups"
        ]  # fmt: skip
        return [*prefix, "bash", "-c", f"set -euo pipefail\n{self.settings}\n{script}"]

    def expand(self, text: str) -> str:
        return re.sub(r"\$(\w+)", lambda m: self.env.get(m.group(1), m.group(0)), text)


def _engine_python() -> Path:
    python = SHARED_ENGINES / "transformers" / "bin" / "python"
    if not python.exists():
        env = {
            **os.environ,
            "XHPC_VENVS_DIR": str(SHARED_ENGINES),
            "XHPC_PYTHON": "/usr/bin/python3",
        }
        subprocess.run([str(ROOT / "scripts" / "setup-engines"), "transformers"], env=env,
                       check=True, capture_output=True, timeout=900)  # fmt: skip
    subprocess.run(["chmod", "-R", "a+rX", str(SHARED_ENGINES)], check=True)
    return python


def _wheel(dest: Path) -> Path:
    dest.mkdir()
    build = Path(tempfile.mkdtemp(prefix="xt-ops-src-", dir="/tmp"))
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                               capture_output=True).stdout.decode().split("\0")  # fmt: skip
        for rel in filter(None, files):
            (build / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, build / rel)
        subprocess.run([str(ROOT / ".venv" / "bin" / "pip"), "wheel", "-q", "--no-deps",
                        "--disable-pip-version-check", "-w", str(dest), str(build)],
                       check=True, capture_output=True, timeout=300)  # fmt: skip
    finally:
        shutil.rmtree(build, ignore_errors=True)
    (wheel,) = dest.glob("xhpc_serve-*.whl")
    return wheel


@pytest.fixture
def site(dev_cluster: Path, tiny_model: Path) -> Iterator[Site]:
    base = Path(tempfile.mkdtemp(prefix="xt-ops-", dir="/tmp"))
    base.chmod(0o755)
    shutil.copytree(tiny_model, base / "models" / "tiny-llama")
    overlay = base / "dev-cluster.toml"
    overlay.write_text(DEV_OVERLAY.format(slurm_conf=SLURM_CONF, python=_engine_python()))
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "SLURM_CONF": str(SLURM_CONF),
        "XHPC_USER_CONFIG": str(overlay),
        "PREFIX": str(base / "opt"),
        "ETC": str(base / "etc"),
        "LAB_STATE": str(base / "state"),
        "MODELS": str(base / "models"),
        "MODEL": "tiny-llama",
        "WHEEL": str(_wheel(base / "dist")),
        "GW_USER": ROLES["gateway"],
        "LAB_GROUP": "xhpc-lab",
        "MEMBER_A": ROLES["member-a"],
        "MEMBER_B": ROLES["member-b"],
        "ACCOUNT": "lab2",
        "GW_PORT": str(free_port()),
    }
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    (settings,) = [b.text for b in guide_blocks(GUIDE.read_text()) if b.tag("settings")]
    s = Site(base, env, settings)
    try:
        yield s
    finally:
        for proc in reversed(s.daemons):  # members' brokers, then the proxy and its broker
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        jobs = [
            j for user in ROLES.values() if user != "root" for j in subprocess.run(
                ["squeue", "-h", "-u", user, "-o", "%i"], env=slurm_env(), capture_output=True,
                text=True, check=False).stdout.split()
        ]  # fmt: skip
        if jobs:
            subprocess.run(["scancel", *jobs], env=slurm_env(), check=False)
        keep = os.environ.get("XHPC_TEST_KEEP_LOGS")
        if keep:
            shutil.copytree(base / "logs", Path(keep) / f"{base.name}-logs", dirs_exist_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def _ready(site: Site, spec: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the daemon exited {proc.returncode}: {log.read_text()[-3000:]}")
    target = site.expand(spec)
    if target.startswith("tcp:"):
        try:
            socket.create_connection(("127.0.0.1", int(target[4:])), timeout=1).close()
        except OSError:
            return False
        return True
    return Path(target).exists()


def _run(site: Site, block: Block, index: int) -> str:
    role = str(block.tag("run-as"))
    logs = site.base / "logs"
    logs.mkdir(exist_ok=True)
    if block.tag("daemon"):
        log = logs / f"{index:02d}-{role}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(site.argv(role, block.text), env=site.env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=site.base)  # fmt: skip
        site.daemons.append(proc)
        spec = str(block.tag("ready"))
        wait_for(lambda: _ready(site, spec, proc, log), 60, f"{role}'s daemon ({spec})")
        return ""
    deadline = time.monotonic() + (60 if block.tag("eventually") else 0)
    while True:
        done = subprocess.run(site.argv(role, block.text), env=site.env, capture_output=True,
                              text=True, timeout=900, cwd=site.base)  # fmt: skip
        (logs / f"{index:02d}-{role}.out").write_text(done.stdout + done.stderr)
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done.returncode == 0, (
        f"block {index} (run-as={role}) failed {done.returncode}:\n{block.text}\n"
        f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    )
    return done.stdout


def test_the_operators_guide_runs_as_written(site: Site) -> None:
    runnable = [b for b in guide_blocks(GUIDE.read_text()) if b.tag("run-as")]
    outputs: dict[str, str] = {}
    for i, block in enumerate(runnable):
        out = _run(site, block, i)
        if "xhpc keys create" in block.text:
            (key,) = KEY_RE.findall(out)  # shown once, handed to the member
            site.env["OPENAI_API_KEY"] = key
        for step in ("xhpc serve", "curl", "xhpc batch submit"):
            if step in block.text:
                outputs[step] = out
    # The member's job is theirs, under the lab's account.
    jobs = subprocess.run(["squeue", "-h", "-u", ROLES["member-a"], "-o", "%u|%a|%T"],
                          env=slurm_env(), capture_output=True, text=True, check=True)  # fmt: skip
    assert f"{ROLES['member-a']}|lab2|RUNNING" in jobs.stdout.split(), jobs.stdout
    # The other member's call was answered by the engine, through TLS and the gateway.
    answer = json.loads(outputs["curl"])
    assert answer["model"] == "tiny-llama", answer
    assert answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["completion_tokens"] > 0, answer
    # The batch ran as the second member's job array, every line answered.
    assert re.search(r": completed \(3 completed, 0 failed of 3;", outputs["xhpc batch submit"])
