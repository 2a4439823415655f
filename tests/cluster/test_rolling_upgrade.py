"""A rolling upgrade on the dev cluster, from the previous release's wheel to this checkout's,
under traffic through two gateways: nothing fails.

The previous release (tests/data/previous-release: its version and commit) is built from this
repository's history into a virtual environment of its own (``scripts/install-wheel --ref``).
Its broker, two gateways and a deployment of two replicas (their agents run the previous
version inside their jobs) serve a client of both gateways (the Python API's failover client),
every answer checked. Then, as docs/operators.md says: this version's broker starts as the
standby, the previous one stops (the new one leads at once and adopts both jobs), each gateway
is replaced in turn while the client uses the other, and a scale-up starts a replica of this
version. The agents of the previous version keep their jobs, heartbeat to the new broker and
stay READY; no call failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import (
    ROOT,
    SITE,
    XHPC,
    free_port,
    queued_jobs,
    slurm_env,
    stop_procs,
    wait_for,
)

pytestmark = pytest.mark.cluster

PREVIOUS_VERSION, PREVIOUS_COMMIT = (
    (ROOT / "tests" / "data" / "previous-release").read_text().split()
)
PREVIOUS_VENV = Path(os.environ.get("XHPC_TEST_PREVIOUS_VENV", "/tmp/xhpc-previous-wheel"))


@pytest.fixture(scope="module")
def previous_xhpc() -> str:
    """The previous release's ``xhpc``, installed from its wheel (built once; kept between runs
    while its content is the same)."""
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    if shallow == "true":
        pytest.skip("a shallow clone: the previous release's commit is not in its history")
    done = subprocess.run(
        [str(ROOT / "scripts" / "install-wheel"), "--ref", PREVIOUS_COMMIT, str(PREVIOUS_VENV)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, f"install-wheel --ref {PREVIOUS_COMMIT}: {done.stderr[-3000:]}"
    xhpc = done.stdout.strip().splitlines()[-1]
    version = subprocess.run([xhpc, "--version"], capture_output=True, text=True, check=True)
    assert PREVIOUS_VERSION in version.stdout, version.stdout
    return xhpc


@dataclass
class Run:
    state: Path
    env: dict[str, str]
    logs: list[Path] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, xhpc: str, *args: str, port: int | None = None) -> None:
        env = dict(self.env)
        if port is not None:
            env["XHPC_PROXY_PORT"] = str(port)
        log = (self.state / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen([xhpc, *args], env=env, stdout=log, stderr=log)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (self.state / f"{name}.log").read_text()[-2000:]

    def log(self, name: str) -> str:
        return (self.state / f"{name}.log").read_text(errors="replace")

    def rows(self, xhpc: str, name: str) -> list[dict[str, Any]]:
        """READY replicas of deployment ``name`` as the broker says to ``xhpc``'s CLI."""
        done = subprocess.run([xhpc, "ps", "--json"], env=self.env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        if done.returncode != 0:
            return []
        return [r for r in json.loads(done.stdout)
                if r["deployment"] == name and r["state"] == "READY"]  # fmt: skip

    def ps(self, xhpc: str, name: str) -> dict[str, str]:
        """READY replicas of deployment ``name``, and their jobs."""
        return {r["replica_id"]: str(r["job_id"]) for r in self.rows(xhpc, name)}


class Traffic(threading.Thread):
    """Chat calls back to back through the Python API's client of both gateways."""

    def __init__(self, ports: tuple[int, int], model: str) -> None:
        super().__init__(daemon=True)
        from xhpc.client.endpoint import Endpoint

        class Both(Endpoint):
            base_url = f"http://127.0.0.1:{ports[0]}/v1"
            fallbacks = (f"http://127.0.0.1:{ports[1]}/v1",)
            api_key = "unused"

        self.client = Both().openai(timeout=20, max_retries=3)
        self.model = model
        self.answers: list[tuple[float, str]] = []  # (when, "" or what was wrong)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                answer = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "hi"}]
                )
                content = answer.choices[0].message.content or ""
                wrong = "" if content.startswith("gpus=") else f"answer {content!r}"
            except Exception as err:  # a failed call is the finding
                wrong = f"{type(err).__name__}: {err}"
            self.answers.append((time.monotonic(), wrong))
            self.stop.wait(0.05)

    def since(self, t: float) -> int:
        return sum(1 for at, wrong in self.answers if at >= t and not wrong)

    def failures(self) -> list[str]:
        return [wrong for _, wrong in self.answers if wrong]


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200 and json.loads(resp.read()).get("routes"))
    except (OSError, ValueError):
        return False


@pytest.fixture
def run(dev_cluster: Path, tiny_model: Path, tmp_path: Path) -> Iterator[Run]:
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="xt-up-", dir="/tmp"))
    (state / "user.toml").write_text(ECHO_ENGINE)
    env = {k: v for k, v in slurm_env().items() if not k.startswith("XHPC_")}
    env.update(XHPC_SITE_CONFIG=str(SITE), XHPC_STATE_DIR=str(state),
               XHPC_USER_CONFIG=str(state / "user.toml"),
               XHPC_MODELS_DIR=str(tiny_model.parent))  # fmt: skip
    r = Run(state, env)
    try:
        yield r
    finally:
        stop_procs(list(r.procs.values()))
        left = queued_jobs(state)
        if left:
            subprocess.run(["scancel", *left], env=slurm_env(), check=False)
        import shutil

        keep = os.environ.get("XHPC_TEST_KEEP_LOGS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for log in state.glob("*.log"):
                shutil.copy(log, Path(keep) / f"upgrade-{log.name}")
        shutil.rmtree(state, ignore_errors=True)


def test_a_rolling_upgrade_from_the_previous_release_fails_no_call(
    run: Run, previous_xhpc: str, unique_name: str
) -> None:
    name = unique_name
    old, new = previous_xhpc, XHPC
    ports = (free_port(), free_port())
    run.start("broker-old", old, "broker")
    wait_for(lambda: (run.state / "broker.sock").exists(), 30, "the previous release's broker")
    for i, port in enumerate(ports):
        run.start(f"gateway{i}-old", old, "proxy", port=port)
    subprocess.run([old, "serve", "tiny-llama", "--name", name, "--engine", "command",
                    "--replicas", "2", "--timeout", "180"], env=run.env, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    before = run.ps(old, name)
    assert len(before) == 2
    wait_for(lambda: all(_health(p) for p in ports), 30, "both gateways routing")
    traffic = Traffic(ports, name)
    traffic.start()
    try:
        wait_for(lambda: traffic.since(0) >= 10, 60, "calls answered by the previous release")

        # 1. This version's broker stands by; the previous one stops: the new one leads.
        run.start("broker-new", new, "broker", "--standby")
        wait_for(lambda: "standby: broker" in run.log("broker-new"), 30, "the new standby")
        run.stop("broker-old")
        wait_for(
            lambda: "standby takes over" in run.log("broker-new"), 15, "the new broker leading"
        )
        wait_for(lambda: run.ps(new, name) == before, 60, "both replicas adopted, READY")
        led = datetime.now(UTC)

        # 2. Each gateway replaced in turn; the client uses the other meanwhile.
        for i, port in enumerate(ports):
            run.stop(f"gateway{i}-old")
            run.start(f"gateway{i}-new", new, "proxy", port=port)
            wait_for(lambda p=port: _health(p), 30, f"the new gateway on {port}")  # type: ignore[misc]
            upgraded = time.monotonic()
            wait_for(lambda t=upgraded: traffic.since(t) >= 10, 60, "calls answered")  # type: ignore[misc]

        # 3. A replica of this version beside the previous version's two.
        subprocess.run([new, "scale", name, "3"], env=run.env, check=True, capture_output=True,
                       timeout=60)  # fmt: skip
        wait_for(lambda: len(run.ps(new, name)) == 3, 120, "a third replica READY")

        # The previous version's agents heartbeat to the new broker: the same jobs, READY, each
        # heard from since it leads.
        def heard() -> bool:
            rows = {r["replica_id"]: r for r in run.rows(new, name)}
            return all(
                rid in rows
                and str(rows[rid]["job_id"]) == job
                and rows[rid]["last_heartbeat"]
                and datetime.fromisoformat(rows[rid]["last_heartbeat"]) > led
                for rid, job in before.items()
            )

        wait_for(heard, 60, "the previous version's agents heard by the new broker")
        seen = time.monotonic()
        wait_for(lambda: traffic.since(seen) >= 10, 60, "calls answered by three replicas")
    finally:
        traffic.stop.set()
        traffic.join(60)
    assert traffic.failures() == [], traffic.failures()[:5]
    assert len(traffic.answers) >= 50
