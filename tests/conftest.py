"""Shared fixtures: the real dev Slurm cluster, the tiny model, and a broker + proxy per test."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.postgres import Postgres, start_postgres
from xhpc.agent import ports

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site-configs" / "dev-cluster.toml"
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"
SLURM_CONF = Path(os.environ.get("XHPC_DEV_DIR", "/tmp/xhpc-dev-cluster")) / "etc" / "slurm.conf"
XHPC = str(Path(sys.executable).parent / "xhpc")
SYSTEM_PYTHON = "/usr/bin/python3"

# Tests that act as other Unix users (setpriv) and run the system's Python as them.
needs_other_users = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or os.geteuid() != 0
    or shutil.which("setpriv") is None
    or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs Linux, root (to act as other uids), setpriv and /usr/bin/python3",
)


def as_uid(uid: int) -> list[str]:
    """argv prefix that runs a command as another Unix user (no groups, no capabilities)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


# The installed package other users run: scripts/install-wheel's environment (scripts/test makes
# it once per run and names it in XHPC_TEST_WHEEL_VENV; otherwise the first test that needs it).
WHEEL_VENV = Path(os.environ.get("XHPC_TEST_WHEEL_VENV", "/tmp/xhpc-test-wheel"))
_INSTALLED: list[Path] = []


def installed_xhpc() -> Path:
    """``xhpc`` from this checkout's wheel, installed (not editable) where every user may run it."""
    if not _INSTALLED:
        done = subprocess.run(
            [str(ROOT / "scripts" / "install-wheel"), str(WHEEL_VENV)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"scripts/install-wheel failed: {done.stderr[-2000:]}"
        _INSTALLED.append(Path(done.stdout.strip().splitlines()[-1]))
    return _INSTALLED[0]


_COPY: list[dict[str, str]] = []


def package_copy_env() -> dict[str, str]:
    """PYTHONPATH for another user's ``/usr/bin/python3`` to import this checkout's package
    and its dependencies from a world-readable copy (hard links where the filesystem allows):
    for unit tests that run xhpc code as a second user without a job (a job's ``python -I``
    ignores PYTHONPATH: those run the installed wheel, ``xhpc_as``)."""
    if not _COPY:
        base = Path(tempfile.mkdtemp(prefix="xhpc-other-copy-", dir="/tmp"))
        atexit.register(shutil.rmtree, base, True)
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        site = Path(sys.executable).parent.parent / "lib" / version / "site-packages"
        for src, dst in ((site, base / "site"), (ROOT / "xhpc", base / "src" / "xhpc")):
            dst.parent.mkdir(parents=True, exist_ok=True)
            if subprocess.run(["cp", "-al", str(src), str(dst)], capture_output=True).returncode:
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst, symlinks=True)
        subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
        os.chmod(base, 0o755)
        _COPY.append({"PYTHONPATH": f"{base / 'src'}:{base / 'site'}"})
    return _COPY[0]


def readable_site_config() -> Path:
    """The dev cluster's site config where every user may read it (this checkout may not be
    readable to them), its relative paths made absolute (they name this checkout's files)."""
    text = SITE.read_text().replace('= "../', f'= "{ROOT}/')
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(f"/tmp/xhpc-test-site-{digest}.toml")
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    return path


def readable_models_dir(tiny_model: Path) -> Path:
    """A models directory holding a copy of ``tiny_model`` that every user may read (this
    checkout's ``models/`` may not be readable to them)."""
    digest = hashlib.sha256(b"".join(
        p.read_bytes() for p in sorted(tiny_model.iterdir()) if p.is_file()
    )).hexdigest()[:12]  # fmt: skip
    base = Path(f"/tmp/xhpc-test-models-{digest}")
    if not (base / tiny_model.name).is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".xhpc-test-models-", dir="/tmp"))
        shutil.copytree(tiny_model, tmp / tiny_model.name)
        subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
        try:
            os.rename(tmp, base)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return base


def xhpc_as(uid: int) -> tuple[list[str], dict[str, str]]:
    """How user ``uid`` runs xhpc (argv, extra environment): the installed wheel, never this
    checkout, which may sit where other users cannot read (a clone in root's 0700 home). Its
    broker's jobs run the agent with that environment's Python (``python -I``: nothing of the
    caller's PYTHONPATH)."""
    del uid  # one installation serves every user
    return [str(installed_xhpc())], {"XHPC_SITE_CONFIG": str(readable_site_config())}


def wait_for(
    predicate: Callable[[], object], timeout_s: float, what: str, step_s: float = 0.2
) -> object:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(step_s)


def free_port() -> int:
    """A port nobody listens on, outside the kernel's ephemeral range (no connection or
    port-0 bind of another test is given it before the test binds it)."""
    return ports.free_port()


def slurm_env() -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(SLURM_CONF)}


def squeue_ids(name_prefix: str = "xhpc-") -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %j"], env=slurm_env(), check=True, capture_output=True, text=True
    ).stdout
    return [
        ln.split()[0]
        for ln in out.splitlines()
        if ln.split()[1:2] and ln.split()[1].startswith(name_prefix)
    ]


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[Path]:
    """The real multi-node dev cluster; brought down at the end if this session started it."""
    started = subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True).returncode != 0
    if started:
        subprocess.run([str(DEV_CLUSTER), "up"], check=True)
    yield SLURM_CONF
    if started:
        subprocess.run([str(DEV_CLUSTER), "down"], check=False)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    out = ROOT / "models" / "tiny-llama"
    subprocess.run(
        [str(ROOT / "scripts" / "make-tiny-model"), str(out)], check=True, capture_output=True
    )
    return out


@pytest.fixture(scope="session")
def tiny_reranker() -> Path:
    """A tiny random cross-encoder (rerank and score), made offline into models/ where the site
    catalog finds it by name."""
    out = ROOT / "models" / "tiny-reranker"
    subprocess.run(
        [str(ROOT / "scripts" / "make-tiny-reranker"), str(out)], check=True, capture_output=True
    )
    return out


def freeze_until_taken_over(proc: subprocess.Popen[bytes], log: Callable[[], str]) -> float:
    """SIGSTOP ``proc`` (the leader) until the standby whose ``log`` this is takes over; the
    seconds that took. A leader frozen inside a write transaction holds SQLite's write lock, so
    the standby cannot take the lease until it resumes (a server database ends such a
    transaction itself): then it is resumed and frozen again, at most three times."""
    for _ in range(3):
        proc.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            wait_for(lambda: "standby takes over" in log(), 12, "the standby leading")
        except AssertionError:
            proc.send_signal(signal.SIGCONT)  # frozen holding the write lock: again
            continue
        return time.monotonic() - frozen
    raise AssertionError("the standby never took over from the frozen leader")


def queued_jobs(
    state_dir: Path, *, live_only: bool = False, env: dict[str, str] | None = None
) -> list[str]:
    """Jobs in squeue whose output goes to ``state_dir``; ``live_only``: not the ones still
    COMPLETING (ending after a cancel)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%t|%o"], env=env or slurm_env(),
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    rows = [ln.split("|", 2) for ln in out.splitlines()]
    ending = ("CG",) if live_only else ()
    return [r[0] for r in rows if len(r) == 3 and str(state_dir) in r[2] and r[1] not in ending]


def stop_procs(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each of ``procs`` still running, the newest first; a kill after 40 s."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                # The proxy drains its workers first ([proxy] drain_grace_s, 30 s): a kill
                # before that would leave its private directory behind.
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Xhpc:
    """A broker and a proxy of this test's own, with their own state dir and port."""

    state_dir: Path
    proxy_port: int
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def run(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [XHPC, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"xhpc {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--json").stdout)

    def start(self, what: str, *args: str, log_name: str | None = None) -> subprocess.Popen[bytes]:
        log = (self.state_dir / f"{log_name or what}.log").open("ab")
        proc = subprocess.Popen([XHPC, what, *args], env=self.env, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        stop_procs(self.procs)

    def my_jobs(self) -> list[str]:
        """Jobs in squeue whose output goes to this test's state dir."""
        return queued_jobs(self.state_dir)

    def wait_no_jobs(self, timeout_s: float = 60) -> None:
        """Until none of this test's jobs is in squeue; on timeout, say what Slurm still holds."""
        try:
            wait_for(lambda: not self.my_jobs(), timeout_s, "no job left")
        except AssertionError as err:
            left = subprocess.run(
                ["squeue", "-h", "-j", ",".join(self.my_jobs()) or "0", "-o", "%i %T %r %N"],
                env=slurm_env(),
                capture_output=True,
                text=True,
            )
            raise AssertionError(f"{err}: {left.stdout.strip()}") from err


def _start_xhpc(tiny_model: Path, user_toml: str = "") -> Xhpc:
    state_dir = Path(tempfile.mkdtemp(prefix="xt-", dir="/tmp"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(
        XHPC_SITE_CONFIG=str(SITE),
        XHPC_STATE_DIR=str(state_dir),
        XHPC_PROXY_PORT=str(port),
        XHPC_MODELS_DIR=str(tiny_model.parent),
    )
    if user_toml:  # "@STATE@": this state directory
        (state_dir / "user.toml").write_text(user_toml.replace("@STATE@", str(state_dir)))
        env["XHPC_USER_CONFIG"] = str(state_dir / "user.toml")
    x = Xhpc(state_dir=state_dir, proxy_port=port, env=env)
    x.start("broker")
    wait_for(lambda: (state_dir / "broker.sock").exists(), 20, "the broker's socket")
    x.start("proxy")
    return x


def _teardown_xhpc(x: Xhpc) -> None:
    # The broker first: a live one would replace the replicas whose jobs are cancelled here.
    x.stop_all()
    leftover = x.my_jobs()
    if leftover:
        subprocess.run(["scancel", *leftover], env=slurm_env(), check=False)
        wait_for(lambda: not x.my_jobs(), 60, "leftover jobs to leave squeue")
    keep = os.environ.get("XHPC_TEST_KEEP_LOGS")  # a directory: the daemons' logs survive here
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for log in x.state_dir.glob("*.log"):
            shutil.copy(log, Path(keep) / f"{x.state_dir.name}-{log.name}")
        # the jobs' output, and the engines' (a unit's job writes into the unit's directory)
        for pattern in ("replicas/*/*.out", "replicas/*/engine-*.log", "units/*/*.out"):
            for out in x.state_dir.glob(pattern):
                shutil.copy(out, Path(keep) / f"{x.state_dir.name}-{out.parent.name}-{out.name}")
    shutil.rmtree(x.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL server for the session's tests (tests/postgres.py); skipped where Debian's
    ``postgresql`` is not installed (scripts/test installs it)."""
    pg = start_postgres()
    if pg is None:
        pytest.skip("PostgreSQL is not installed (apt: postgresql; scripts/test installs it)")
    try:
        yield pg
    finally:
        pg.stop()


@contextmanager
def own_xhpc(tiny_model: Path, user_toml: str = "") -> Iterator[Xhpc]:
    """A broker and a proxy with a user config of the test's own, torn down however it ends."""
    x = _start_xhpc(tiny_model, user_toml)
    try:
        yield x
    finally:
        _teardown_xhpc(x)


@pytest.fixture
def xhpc(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    """A broker and a proxy of this test's own, on the dev cluster."""
    x = _start_xhpc(tiny_model)
    yield x
    _teardown_xhpc(x)


# For tests about Slurm placement, not serving: the `command` engine runs `sleep`, so a replica
# holds its GPUs (STARTING) without spending the machine's two cores on engines.
PLACEHOLDER_ENGINE = """
[engines.command]
command = ["sleep", "900"]
startup_timeout_s = 900
"""


@pytest.fixture
def xhpc_placeholder(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, PLACEHOLDER_ENGINE)
    yield x
    _teardown_xhpc(x)


@pytest.fixture
def unique_name() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@dataclass
class NodeProbes:
    """`xhpc probe` running inside each node's namespace with the fake backend."""

    files: dict[str, Path]

    def write(self, node: str, toml: str) -> None:
        tmp = self.files[node].with_suffix(".tmp")
        tmp.write_text(toml)
        tmp.replace(self.files[node])  # atomic: the probe re-reads the file at every sample


@pytest.fixture
def node_probes(xhpc_placeholder: Xhpc) -> NodeProbes:
    x = xhpc_placeholder
    files: dict[str, Path] = {}
    for k in (1, 2, 3):
        node = f"n{k}"
        files[node] = x.state_dir / f"fake-{node}.toml"
        files[node].write_text("count = 4\n")
        log = (x.state_dir / f"probe-{node}.log").open("ab")
        # Started after the broker and the proxy, so stopped before them.
        x.procs.append(
            subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/xhpc-{node}",
                    XHPC,
                    "probe",
                    "--node",
                    node,
                    "--backend",
                    "fake",
                    "--fake-file",
                    str(files[node]),
                    "--interval",
                    "0.5",
                ],
                env=x.env,
                stdout=log,
                stderr=log,
            )
        )

    def all_fresh() -> bool:
        nodes = x.json("nodes")["nodes"]  # type: ignore[index]
        return all(n["probe_fresh"] for n in nodes)

    wait_for(all_fresh, 30, "every node's probe to report")
    return NodeProbes(files)


LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran its own broker and proxy shows the tails of their logs (CI keeps
    nothing else): what the daemons saw is what explains a fault test's failure."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        if not isinstance(value, Xhpc):
            continue
        for log in sorted(value.state_dir.glob("*.log")):
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            tail = "\n".join(line[:300] for line in lines[-LOG_TAIL_LINES:])
            report.sections.append((f"{log.name} (last {LOG_TAIL_LINES} lines)", tail))
