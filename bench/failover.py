"""Failover between the dev cluster's two login nodes, under steady traffic (docs/performance.md).

Both login nodes (login 1: the root namespace; login 2: ``scripts/dev-cluster login2``) run a
broker on one state (the shared state directory and a PostgreSQL database of the run's own on
the dev cluster's server) and a gateway. The broker on login 2 leads; login 1's stands by. A
deployment of two replicas (the ``command`` engine: tests/data/engines/echo_engine.py) serves
calls from two clients side by side:

    one address     the openai SDK on login 2's gateway only
    both addresses  the Python API's openai client with ``[proxy] gateways`` = login 2, login 1
                    (xhpc.client.failover: the next gateway when one cannot be reached)

each with ``--clients`` threads calling back to back, every answer checked (a 200 from the echo
engine, whole). Then:

1. **Login 2 dies** (``scripts/dev-cluster login2-fail``: its link cut, every process on it
   killed: the leader, its gateway), and one replica's job is cancelled at the same moment (a
   replacement falls due while no broker leads), and a call goes to a second, autoscaled
   deployment asleep (no job) through login 1's gateway, which holds it (a wake falls due), a
   second before a third deployment's replica is due its walltime handover (its job's time
   limit two minutes, the handover a minute before it).
   It stays down until the client of one address has lost a call (its SDK's retries spent:
   about half a minute). Figures: seconds until login 1's broker leads (its log's takeover
   line); the calls each client lost; when the held call was answered;
   whether the cancelled replica was replaced; and the jobs: every job in the queue is a live
   replica's (0 duplicates), the other replica kept its job (adopted by its tag, not
   relaunched: 0 lost).
2. **The new leader frozen past its lease** (SIGSTOP), with login 2 back and a standby broker
   there: login 2's broker leads; the frozen one, resumed, stops with its one-line error (exit
   4), having submitted nothing: the queue still holds exactly the live replicas' jobs.

Before the faults, login 1's gateway alone answers calls: login 1's broker, a standby, serves
its login node's socket as a relay to the leader (xhpc.broker.relay), since a Unix socket does
not cross hosts.

Targets (``--json``): the standby leads within 10 s of the login node's death; 0 failed calls
for the client of both addresses; 0 duplicate or lost jobs; the replacement due during the
outage happens; the frozen former leader is fenced (exit 4, nothing submitted); the standby's
login node's gateway serves through the relay; the wake and the walltime handover due during
the outage happen.

    .venv/bin/python bench/failover.py [--calls-after N] [--json FILE]

About 3 minutes. Needs the dev cluster up (``scripts/dev-cluster up``: PostgreSQL and login 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # xhpc, bench._common

from bench._common import (  # noqa: E402
    Procs,
    free_port,
    logger,
    run_on_tiny_model,
    wait,
)
from bench._failover.figures import (  # noqa: E402
    CONTENDERS,
    STANDBY_CALLS,
    Call,
    table,
    targets,
)

log = logger("failover")
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"
SITE = ROOT / "site-configs" / "dev-cluster.toml"
XHPC = str(Path(sys.executable).parent / "xhpc")
ECHO = ROOT / "tests" / "data" / "engines" / "echo_engine.py"
LOGIN = {1: "10.77.0.1", 2: "10.77.0.2"}
HANDOVER_FLOOR_S = 60  # a job of HANDOVER_TIME gets its successor this long before its end
HANDOVER_TIME = "00:02:00"
NODE_TOML = """
state_dir = "{state}"
db_url = "{db_url}"

[broker]
agent_bind = "{address}"

[proxy]
host = "{address}"
port = {port}
gateways = ["http://{login2}:{port}", "http://{login1}:{port}"]

[lifecycle]
handover_floor_s = {handover_floor_s}

[engines.command]
command = ["{python}", "{echo}", "--port", "{{port}}", "--served-model", "{{served_model}}"]
startup_timeout_s = 60
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the figures and targets here")
    ap.add_argument("--clients", type=int, default=2, help="threads per client (2)")
    ap.add_argument(
        "--calls-after",
        type=int,
        default=20,
        help="calls each client answers after each fault before the next step (20)",
    )
    args = ap.parse_args(argv)  # fmt: skip
    if args.clients < 1 or args.calls_after < 1:
        ap.error("--clients and --calls-after must be at least 1")
    return args


# -- the run --------------------------------------------------------------------------------------
def answer_error(status: int, body: Any) -> str:
    """ "" for a whole answer of the echo engine; else what was wrong with it."""
    try:
        content = body.choices[0].message.content
        ok = (
            status == 200
            and str(body.id).startswith("chatcmpl-echo-")
            and content.startswith("gpus=")
        )
    except (AttributeError, IndexError, TypeError):
        ok = False
    return "" if ok else f"HTTP {status}: {str(body)[:200]}"


class Clients:
    """``n`` threads per contender, each calling ``model`` back to back until stopped."""

    def __init__(self, make: dict[str, Callable[[], Any]], model: str, n: int, t0: float) -> None:
        self.calls: list[Call] = []
        self.stop = threading.Event()
        self.model, self.t0 = model, t0
        self.threads = [
            threading.Thread(target=self._loop, args=(name, factory), daemon=True)
            for name, factory in make.items()
            for _ in range(n)
        ]

    def _loop(self, contender: str, factory: Callable[[], Any]) -> None:
        client = factory()
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                answer = client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                error = answer_error(200, answer)
            except Exception as err:  # every failure is a figure, not a crash
                error = f"{type(err).__name__}: {str(err)[:200]}"
            self.calls.append(Call(contender, began - self.t0, time.monotonic() - began, error))
            self.stop.wait(0.05)

    def failed(self, contender: str) -> int:
        return sum(1 for c in self.calls if c.contender == contender and c.error)

    def answered_since(self, contender: str, t: float) -> int:
        return sum(1 for c in self.calls if c.contender == contender and c.at >= t and not c.error)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


@dataclass
class Site:
    """Two login nodes' brokers and gateways on one state."""

    work: Path
    db: str
    db_url: str
    port: int
    procs: Procs
    env: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def state(self) -> Path:
        return self.work / "state"

    def argv(self, node: int, *args: str) -> list[str]:
        return [str(DEV_CLUSTER), "login2", XHPC, *args] if node == 2 else [XHPC, *args]

    def start(self, name: str, node: int, *args: str) -> subprocess.Popen[bytes]:
        return self.procs.start(name, self.argv(node, *args), self.env[node])

    def xhpc(self, *args: str, node: int = 1) -> str:
        done = subprocess.run(self.argv(node, *args), env=self.env[node], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"xhpc {' '.join(args)}: exit {done.returncode}: {done.stderr}")
        return done.stdout

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        rows = json.loads(self.xhpc("ps", "--json"))
        return [r for r in rows if r["deployment"] == deployment]

    def live_jobs(self, deployment: str) -> set[str]:
        """The jobs of ``deployment``'s replicas that are not STOPPED."""
        return {str(r["job_id"]) for r in self.replicas(deployment)
                if r["state"] != "STOPPED" and r["job_id"]}  # fmt: skip

    def queue(self) -> set[str]:
        """The live jobs in squeue whose output goes to this run's state directory (a job still
        COMPLETING after its cancel is ending, not live: it is no duplicate)."""
        from tests.conftest import queued_jobs

        return set(queued_jobs(self.state, live_only=True, env=self.env[1]))


def _psql(sql: str, db_url: str) -> None:
    subprocess.run(["psql", db_url, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True,
                   capture_output=True, cwd="/", timeout=60)  # fmt: skip


def make_site(work: Path, procs: Procs) -> Site:
    base = subprocess.run([str(DEV_CLUSTER), "db-url"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    db = f"xhpc_failover_{os.getpid()}"
    _psql(f"CREATE DATABASE {db}", base)
    site = Site(work, db, base.replace("/xhpc?", f"/{db}?"), free_port(), procs)
    site.state.mkdir(mode=0o700)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    for node in (1, 2):
        toml = work / f"login{node}.toml"
        toml.write_text(NODE_TOML.format(
            state=site.state, db_url=site.db_url, address=LOGIN[node], port=site.port,
            login1=LOGIN[1], login2=LOGIN[2], python=sys.executable, echo=ECHO,
            handover_floor_s=HANDOVER_FLOOR_S,
        ))  # fmt: skip
        site.env[node] = {**clean, "XHPC_SITE_CONFIG": str(SITE), "XHPC_USER_CONFIG": str(toml),
                          "SLURM_CONF": f"{os.environ.get('XHPC_DEV_DIR', '/tmp/xhpc-dev-cluster')}"
                          "/etc/slurm.conf"}  # fmt: skip
    return site


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return wait(predicate, timeout_s, what, step_s=0.1)


def _ready_jobs(site: Site, name: str) -> dict[str, str]:
    """READY replicas' jobs; {} while no broker answers (between a leader's death and the
    takeover)."""
    try:
        rows = site.replicas(name)
    except RuntimeError:
        return {}
    return {r["replica_id"]: str(r["job_id"]) for r in rows if r["state"] == "READY"}


def _clients(site: Site) -> dict[str, Callable[[], Any]]:
    import openai

    from xhpc.client.endpoint import Endpoint

    class Both(Endpoint):
        base_url = f"http://{LOGIN[2]}:{site.port}/v1"
        fallbacks = (f"http://{LOGIN[1]}:{site.port}/v1",)
        api_key = "unused"

    return {
        "one address": lambda: openai.OpenAI(base_url=Both.base_url, api_key="unused",
                                             timeout=10, max_retries=2),
        "both addresses": lambda: Both().openai(timeout=10, max_retries=3),
    }  # fmt: skip


def _stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def _handover_due(site: Site, deployment: str) -> tuple[str, float] | None:
    """The READY replica of ``deployment`` and when its handover is due (a Unix time)."""
    for r in site.replicas(deployment):
        due = (r.get("outlook") or {}).get("handover_at")
        if r["state"] == "READY" and due:
            return str(r["replica_id"]), _stamp(due)
    return None


def _handed_over(
    site: Site, deployment: str, pred: str, killed_at: float, due: float
) -> dict[str, Any]:
    """Whether ``pred``'s successor was submitted after the node's death (by the new leader)
    and READY before ``pred``'s job ended (its handover due + the floor)."""
    end = due + HANDOVER_FLOOR_S

    def successor() -> dict[str, Any] | None:
        rows = site.replicas(deployment)
        return next((r for r in rows if r.get("successor_of") == pred and r["state"] == "READY"),
                    None)  # fmt: skip

    try:
        found = _wait(successor, max(1.0, end - time.time()), "the successor READY")
    except TimeoutError:
        return {"ready_left_s": None}
    return {"ready_left_s": end - time.time(), "successor": found["replica_id"],
            "by_new_leader": _stamp(found["created_at"]) >= killed_at}  # fmt: skip


class Waker:
    """One call to an asleep deployment through login 1's gateway, made as login 2 dies: the
    gateway holds it until a broker wakes the deployment (the new leader, once it leads)."""

    def __init__(self, site: Site, model: str, since: float) -> None:
        self.site, self.model, self.since = site, model, since
        self.answered_at: float | None = None
        self.thread = threading.Thread(target=self._call, daemon=True)
        self.thread.start()

    def _call(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"http://{LOGIN[1]}:{self.site.port}/v1",
                               api_key="unused", timeout=170, max_retries=0)  # fmt: skip
        try:
            answer = client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        except openai.OpenAIError as err:
            log(f"the call to the asleep deployment failed: {err}")
            return
        if answer_error(200, answer) == "":
            self.answered_at = time.monotonic()

    def result(self) -> float | None:
        """Seconds from the node's death to the answer; None if it never came whole."""
        self.thread.join(180)
        return None if self.answered_at is None else self.answered_at - self.since


def _through_login1(site: Site, name: str) -> dict[str, Any]:
    """``STANDBY_CALLS`` calls through login 1's gateway alone while login 2 leads: its routing
    table comes through the standby's relay (its own socket, broker.<host>.sock)."""
    import openai

    client = openai.OpenAI(base_url=f"http://{LOGIN[1]}:{site.port}/v1", api_key="unused",
                           timeout=10, max_retries=0)  # fmt: skip
    answered = 0
    for _ in range(STANDBY_CALLS):
        try:
            answer = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            answered += answer_error(200, answer) == ""
        except openai.OpenAIError as err:
            log(f"a call through login 1's gateway failed: {err}")
    relayed = "relays to the leader" in site.log("broker-login1")
    return {"answered": answered, "relayed": relayed}


def _freeze_until_led(proc: subprocess.Popen[bytes], led: Callable[[], bool]) -> float:
    """SIGSTOP ``proc`` until ``led``; the seconds that took (PostgreSQL ends a transaction the
    frozen one left open after 5 s, so the standby is never locked out)."""
    os.kill(proc.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        _wait(led, 30, "the standby leading while the leader is frozen")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return time.monotonic() - frozen


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    procs = Procs(work, die_with_parent=True, grace_s=20.0)
    site = make_site(work, procs)
    name, sleeper = f"fo-{os.getpid()}", f"fo-sleep-{os.getpid()}"
    handing = f"fo-time-{os.getpid()}"
    data: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    clients: Clients | None = None
    try:
        leader = site.start("broker-login2", 2, "broker")
        _wait(lambda: "broker up" in site.log("broker-login2"), 60, "login 2's broker")
        site.start("broker-login1", 1, "broker", "--standby")
        _wait(lambda: "standby: broker" in site.log("broker-login1"), 60, "login 1's standby")
        for node in (2, 1):
            site.start(f"gateway-login{node}", node, "proxy")
        # A replica whose job's time limit is near: its handover falls due during the outage.
        site.xhpc("serve", "tiny-llama", "--name", handing, "--engine", "command", "--time",
                  HANDOVER_TIME, "--timeout", "180")  # fmt: skip
        site.xhpc("serve", "tiny-llama", "--name", name, "--engine", "command", "--replicas", "2",
                  "--timeout", "180")  # fmt: skip
        before = _wait(lambda: (lambda j: j if len(j) == 2 else None)(_ready_jobs(site, name)),
                       60, "two replicas READY")  # fmt: skip
        # An autoscaled deployment asleep (its one replica ended when idle): a call wakes it.
        site.xhpc("serve", "tiny-llama", "--name", sleeper, "--engine", "command", "--min", "0",
                  "--max", "1", "--target-inflight", "1", "--idle", "10",
                  "--timeout", "180")  # fmt: skip
        _wait(lambda: not site.live_jobs(sleeper), 120, f"{sleeper} asleep")
        log(f"{name}: two replicas READY on jobs {sorted(before.values())}")
        t0 = time.monotonic()
        clients = Clients(_clients(site), name, args.clients, t0)
        clients.start()
        _wait(lambda: all(clients.answered_since(k, 0) >= args.calls_after for k in CONTENDERS),
              120, "calls answered through both gateways")  # fmt: skip

        # 0. Login 1's gateway serves while login 2 leads: its broker relays to the leader.
        data["standby_gateway"] = _through_login1(site, name)

        # 1. Login 2 dies while it leads, a second before a handover is due; a replica's job is
        # cancelled at the same moment.
        pred, due = _wait(lambda: _handover_due(site, handing), 60, "the handover's time")
        _wait(lambda: time.time() >= due - 1.0, 120, "a second before the handover")
        (gone_rid, gone_job), (kept_rid, kept_job) = sorted(before.items())
        killed, killed_at = time.monotonic(), time.time()
        subprocess.run([str(DEV_CLUSTER), "login2-fail"], check=True, capture_output=True)
        subprocess.run(["scancel", gone_job], env=site.env[1], check=True)
        log(f"login 2 killed; job {gone_job} of {gone_rid} cancelled")
        waking = Waker(site, sleeper, killed)  # held by login 1's gateway until a leader wakes it
        try:
            _wait(lambda: "standby takes over" in site.log("broker-login1"), 60, "the takeover")
            data["takeover_s"] = time.monotonic() - killed
        except TimeoutError:
            data["takeover_s"] = None
        log(f"login 1 leads after {data['takeover_s']} s")
        leader.wait(10)  # killed with its node

        def replaced() -> bool:
            jobs = _ready_jobs(site, name)
            return len(jobs) == 2 and gone_job not in jobs.values()

        try:
            _wait(replaced, 180, "the cancelled replica READY again")
            data["replaced_s"] = time.monotonic() - killed
        except TimeoutError:
            data["replaced_s"] = None
        data["woken_s"] = waking.result()
        data["handover"] = _handed_over(site, handing, pred, killed_at, due)
        site.xhpc("stop", handing)  # its next handover would be due during step 2
        after = time.monotonic() - t0
        _wait(lambda: clients.answered_since("both addresses", after) >= args.calls_after, 120,
              "calls answered after the takeover")  # fmt: skip
        # The outage lasts until the client of one address has lost a call (its retries spent).
        with _suppress():
            _wait(lambda: clients.failed("one address"), 120, "a call of one address lost")
        now = _ready_jobs(site, name)
        queue = site.queue()
        live = site.live_jobs(name) | site.live_jobs(sleeper) | site.live_jobs(handing)
        data["jobs"] = {
            "before": before, "after": now, "queue": sorted(queue),
            "duplicates": len(queue - live),
            "lost": int(now.get(kept_rid) != kept_job) + int(len(now) < 2),
        }  # fmt: skip

        # 2. Login 2 back, a standby there; the leader on login 1 frozen past its lease.
        subprocess.run([str(DEV_CLUSTER), "login2-up"], check=True, capture_output=True)
        site.start("standby-login2", 2, "broker", "--standby")
        site.start("gateway-login2-again", 2, "proxy")
        _wait(lambda: "standby: broker" in site.log("standby-login2"), 60, "login 2's standby")
        jobs_then = site.queue()
        frozen = procs.procs["broker-login1"]
        data["freeze_takeover_s"] = _freeze_until_led(
            frozen, lambda: "standby takes over" in site.log("standby-login2")
        )
        try:
            code: int | None = frozen.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        _wait(lambda: len(_ready_jobs(site, name)) == 2, 120, "both replicas READY again")
        submitted = len(site.queue() - jobs_then)
        data["fenced"] = {
            "exit": code,
            "submitted": submitted,
            "last_line": (site.log("broker-login1").strip().splitlines() or [""])[-1],
        }
        again = time.monotonic() - t0  # fmt: skip
        _wait(lambda: clients.answered_since("both addresses", again) >= args.calls_after, 120,
              "calls answered under login 2's broker")  # fmt: skip
    finally:
        if clients is not None:
            clients.join()
            data["calls"] = [asdict(c) for c in clients.calls]
        teardown(site, name, sleeper, handing)
    return data


def teardown(site: Site, *names: str) -> None:
    for name in names:
        with _suppress():
            site.xhpc("stop", name)
    site.procs.stop()
    left = site.queue()
    if left:
        subprocess.run(["scancel", *left], env=site.env[1], check=False)
        with _suppress():
            _wait(lambda: not site.queue(), 60, "the run's jobs to leave the queue")
    base = site.db_url.replace(f"/{site.db}?", "/xhpc?")
    with _suppress():
        _psql(f"DROP DATABASE IF EXISTS {site.db} WITH (FORCE)", base)
    keep = os.environ.get("XHPC_TEST_KEEP_LOGS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for path in site.work.glob("*.log"):
            shutil.copy(path, Path(keep) / f"failover-{path.name}")
    shutil.rmtree(site.work, ignore_errors=True)  # the state directory holds secrets


class _suppress:
    """Teardown goes on past a step that fails (said on stderr)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 _tb: object) -> bool:  # fmt: skip
        if err is not None and isinstance(err, Exception):
            log(f"teardown: {type(err).__name__}: {err}")
            return True
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_on_tiny_model("failover", args.json, lambda work: run(args, work), targets, table)


if __name__ == "__main__":
    sys.exit(main())
