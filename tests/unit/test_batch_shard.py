"""A batch's shard with a real (stdlib) engine behind `xhpc run-server`, and the broker's batch
desk deciding on Slurm's listings (a recording Slurm): answers, malformed lines, a resumed
shard, requeues of unfinished shards, completion, failure and cancel."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.proxy_fakes import free_port
from xhpc.access import Caller, ModelAccess
from xhpc.agent.batch_shard import run_shard
from xhpc.batch.lines import ProgressFile, read_progress
from xhpc.batch.spec import SPEC_FILE, BatchRequest, BatchStatus, progress_path
from xhpc.broker.batches import batch_desk
from xhpc.broker.batches.batch_desk import MAX_REQUEUES, BatchDesk
from xhpc.errors import NotFoundError, ValidationError
from xhpc.models import EngineKind, JobInfo, Route, RoutingTable
from xhpc.settings import EngineConfig, ModelEntry, XhpcConfig

ENGINES = Path(__file__).resolve().parents[1] / "data" / "engines"
ECHO = [
    "{python}", "-m", "echo_engine", "--host", "{host}", "--port", "{port}",
    "--served-model", "{served_model}",
]  # fmt: skip
CHAT = "/v1/chat/completions"
ME = Caller(user="me", uid=os.getuid())
OTHER = Caller(user="other", uid=os.getuid() + 1)


def request_line(cid: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": cid}], "max_tokens": 2}
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": body})


class Slurm:
    def __init__(self) -> None:
        self.submitted: list[Path] = []
        self.cancelled: list[str] = []
        self.requeued: list[str] = []

    async def submit(self, script: Path) -> str:
        self.submitted.append(script)
        return str(500 + len(self.submitted))

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None:
        self.cancelled.extend(job_ids)

    async def requeue(self, job_ids: Sequence[str]) -> None:
        self.requeued.extend(job_ids)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> XhpcConfig:
    """A model served by the echo engine, as a site file (for run-server in the shard) and as
    the loaded config (for the desk); this process plays a job holding GPUs 0 and 1."""
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    toml = tmp_path / "site.toml"
    toml.write_text(
        f'cpu_only = true\n[models.m]\npath = "{model}"\nengine = "command"\n'
        f'[engines.command]\npython = "{sys.executable}"\ncommand = {json.dumps(ECHO)}\n'
        f'startup_timeout_s = 20\n[engines.command.env]\nPYTHONPATH = "{ENGINES}"\n'
    )
    for name in [k for k in os.environ if k.startswith("XHPC_")]:
        monkeypatch.delenv(name)
    jobtmp = tmp_path / "jobtmp"
    jobtmp.mkdir()
    monkeypatch.setenv("XHPC_SITE_CONFIG", str(toml))
    monkeypatch.setenv("XHPC_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1")
    monkeypatch.setenv("TMPDIR", str(jobtmp))
    engine = EngineConfig(python=Path(sys.executable), command=ECHO,
                          env={"PYTHONPATH": str(ENGINES)}, startup_timeout_s=20)  # fmt: skip
    return XhpcConfig(
        state_dir=tmp_path / "state",
        models={"m": ModelEntry(path=model, engine=EngineKind.COMMAND)},
        engines={EngineKind.COMMAND: engine},
        cpu_only=True,
    )


def batch(desk: BatchDesk, text: str, user: str = "me", **fields: Any) -> BatchRequest:
    """A request for ``text``, uploaded as ``user``'s input first."""
    return BatchRequest(input_id=desk.inputs.save(user, text), **fields)


def listed(job: str, task: int, state: str) -> JobInfo:
    return JobInfo(job_id=f"{job}_{task}", raw_job_id=int(job) + 1 + task, name="b",
                   state=state, array_job_id=int(job), array_task_id=task)  # fmt: skip


async def test_a_shard_answers_its_lines_once_and_a_rerun_sends_only_what_is_missing(
    site: XhpcConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    lines = [request_line(f"q{i}") for i in range(6)]
    lines[2] = json.dumps({"custom_id": "q2", "url": CHAT})  # JSON, but no request
    req = batch(desk, "\n".join(lines), model="m", shards=2, gpus=1)
    view = await desk.create(req, ME)
    path = site.resolved_state_dir / "batches" / view.id
    script = slurm.submitted[0].read_text()
    assert "#SBATCH --array=0-1" in script and "--gres=gpu:1" in script and "--requeue" in script
    assert view.status is BatchStatus.IN_PROGRESS and view.request_counts.total == 6
    spec = json.loads((path / SPEC_FILE).read_text())
    assert spec["served_model"] == "m" and spec["shards"] == 2

    # Shard 1 ran before and was killed after answering q3: its rerun sends q4 and q5 only.
    before = ProgressFile(progress_path(path, 1))
    before.add(3, True, {"custom_id": "q3", "from": "the first run"})
    before.close()
    assert (await run_shard(path, 0)) == {"completed": 2, "failed": 1}
    assert (await run_shard(path, 1)) == {"completed": 3, "failed": 0}
    records = [json.loads(x) for x in progress_path(path, 1).read_text().splitlines()]
    assert sorted(r["line"] for r in records) == [3, 4, 5]  # q3 kept, not sent again
    assert records[0]["out"]["from"] == "the first run"
    sent = [(path / "shards" / f"{k}.sent").stat().st_size for k in (0, 1)]
    assert sent == [2, 2]  # q0, q1 (the broken line is not sent); q4, q5 (q3 was kept)
    assert read_progress(progress_path(path, 0)).done == {0: True, 1: True, 2: False}

    # The array is gone from Slurm and every line is answered: the batch completes.
    await desk.refresh([])
    done = desk.get(view.id, ME)
    assert done.status is BatchStatus.COMPLETED and done.completed_at is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    outs = [json.loads(x) for x in desk.output(view.id, ME).splitlines()]
    errs = [json.loads(x) for x in desk.output(view.id, ME, errors=True).splitlines()]
    assert [o["custom_id"] for o in outs] == ["q0", "q1", "q3", "q4", "q5"]
    fresh = [o for o in outs if o["custom_id"] != "q3"]
    for out in fresh:
        assert out["response"]["status_code"] == 200
        assert out["response"]["body"]["choices"][0]["message"]["content"].startswith("gpus=")
    assert [e["error"]["message"] for e in errs] == ["line 3: body must be a JSON object"]
    with pytest.raises(NotFoundError):  # another user's batch: none, to them
        desk.get(view.id, OTHER)
    assert desk.all(OTHER) == [] and [v.id for v in desk.all(ME)] == [view.id]


async def test_unfinished_shards_are_requeued_then_the_batch_fails_with_what_it_has(
    site: XhpcConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_desk, "SETTLE_S", 0.0)
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    lines = "\n".join(request_line(f"q{i}") for i in range(4))
    view = await desk.create(batch(desk, lines, model="m", shards=2), ME)
    job = str(view.job_id)
    path = site.resolved_state_dir / "batches" / view.id
    done = ProgressFile(progress_path(path, 0))  # shard 0 finished; shard 1 never answered
    done.add(0, True, {"custom_id": "q0"})
    done.add(1, True, {"custom_id": "q1"})
    done.close()

    await desk.refresh([listed(job, 1, "RUNNING")])  # still running: nothing to do
    assert slurm.requeued == []
    for round_ in range(1, MAX_REQUEUES + 1):
        await desk.refresh([listed(job, 0, "COMPLETED"), listed(job, 1, "FAILED")])
        assert slurm.requeued == [f"{job}_1"] * round_  # only the unfinished shard
        assert desk.get(view.id, ME).status is BatchStatus.IN_PROGRESS
    await desk.refresh([])
    failed = desk.get(view.id, ME)
    assert failed.status is BatchStatus.FAILED and "shard(s) 1" in failed.errors[0]
    assert [json.loads(x)["custom_id"] for x in desk.output(view.id, ME).splitlines()] == [
        "q0",
        "q1",
    ]


async def test_cancel_stops_the_array_and_keeps_what_was_answered(site: XhpcConfig) -> None:
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    lines = "\n".join(request_line(f"q{i}") for i in range(3))
    view = await desk.create(batch(desk, lines, model="m"), ME)
    path = site.resolved_state_dir / "batches" / view.id
    partial = ProgressFile(progress_path(path, 0))
    partial.add(0, True, {"custom_id": "q0"})
    partial.close()
    with pytest.raises(NotFoundError):
        await desk.cancel(view.id, OTHER)
    cancelling = await desk.cancel(view.id, ME)
    assert cancelling.status is BatchStatus.CANCELLING and slurm.cancelled == [view.job_id]
    await desk.refresh([listed(str(view.job_id), 0, "RUNNING")])
    assert desk.get(view.id, ME).status is BatchStatus.CANCELLING  # until its task is gone
    await desk.refresh([])
    cancelled = desk.get(view.id, ME)
    assert cancelled.status is BatchStatus.CANCELLED and cancelled.request_counts.completed == 1
    assert [json.loads(x)["custom_id"] for x in desk.output(view.id, ME).splitlines()] == ["q0"]


async def test_bad_batches_are_refused_and_leave_nothing(site: XhpcConfig) -> None:
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    one = request_line("a")
    with pytest.raises(ValidationError, match="no requests"):
        desk.inputs.save("me", "\n\n")
    with pytest.raises(ValidationError, match="line 2 of the input: not JSON"):
        desk.inputs.save("me", f"{one}\n{{broken\n")
    bad = {
        "unique": batch(desk, f"{one}\n{one}", model="m"),
        "unsupported endpoint": batch(desk, one, model="m", endpoint="/v1/images"),
        "unknown engine": batch(desk, one, model="m", engine="nope"),
    }
    for why, req in bad.items():
        with pytest.raises(ValidationError, match=why):
            await desk.create(req, ME)
    with pytest.raises(NotFoundError):
        await desk.create(batch(desk, one, model="nope"), ME)
    with pytest.raises(NotFoundError, match="no batch input"):
        await desk.create(batch(desk, one, model="m"), OTHER)  # me's input, not other's
    with pytest.raises(NotFoundError):
        desk.get("batch_../../etc", ME)
    assert slurm.submitted == []
    root = site.resolved_state_dir / "batches"
    assert not root.exists() or list(root.iterdir()) == []


async def test_an_online_batch_goes_to_the_running_replicas_with_no_job_of_its_own(
    site: XhpcConfig, tmp_path: Path
) -> None:
    """The broker sends the lines to the deployment's READY replicas (the echo engine here),
    under the name they serve; with none READY the batch is refused."""
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "echo_engine", "--host", "127.0.0.1", "--port", str(port),
         "--served-model", "served-as"],
        env={**os.environ, "PYTHONPATH": str(ENGINES), "CUDA_VISIBLE_DEVICES": "3"},
    )  # fmt: skip
    try:
        route = Route(model="dep", replica_id="dep-0", url=f"http://127.0.0.1:{port}",
                      served_model="served-as")  # fmt: skip
        table = RoutingTable(version=1, models=("dep",), routes=(route,))
        routes = {"table": RoutingTable()}
        slurm = Slurm()
        mine = (ModelAccess(model="dep", owner="me"),)
        desk = BatchDesk(site, slurm, "b0", "me", lambda: routes["table"], lambda: mine)  # type: ignore[arg-type]
        lines = "\n".join(request_line(f"q{i}") for i in range(5))
        with pytest.raises(ValidationError, match="no READY replica"):
            await desk.create(batch(desk, lines, model="dep", online=True), ME)
        routes["table"] = table
        await _until_listening(port)
        with pytest.raises(NotFoundError, match="no deployment 'dep' you may use"):
            await desk.create(batch(desk, lines, model="dep", online=True, user="other"), OTHER)
        view = await desk.create(batch(desk, lines, model="dep", online=True), ME)
        assert view.online and view.job_id is None and slurm.submitted == []
        for _ in range(200):
            await desk.refresh([])
            if desk.get(view.id, ME).status is BatchStatus.COMPLETED:
                break
            await asyncio.sleep(0.05)
        done = desk.get(view.id, ME)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 5
        outs = [json.loads(x) for x in desk.output(view.id, ME).splitlines()]
        assert [o["custom_id"] for o in outs] == [f"q{i}" for i in range(5)]
        assert all(o["response"]["body"]["model"] == "served-as" for o in outs)
    finally:
        engine.kill()
        engine.wait()


async def _until_listening(port: int) -> None:
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError(f"nothing listens on {port}")


def _bytes_read() -> int:
    """What this process has read from files and pipes so far (Linux: ``rchar``)."""
    io = Path("/proc/self/io").read_text()
    return int(next(ln for ln in io.splitlines() if ln.startswith("rchar:")).split()[1])


@pytest.mark.adversarial
async def test_a_reconcile_reads_only_what_the_shards_appended_since_the_last_one(
    site: XhpcConfig,
) -> None:
    """Failed on 6d94085 before the fix: every reconcile read every shard's progress file
    whole: here 5 MB again each time, for ten new lines."""
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    lines = "\n".join(request_line(f"q{i}") for i in range(2000))
    view = await desk.create(batch(desk, lines, model="m"), ME)
    running = [listed(str(view.job_id), 0, "RUNNING")]
    path = site.resolved_state_dir / "batches" / view.id
    progress = ProgressFile(progress_path(path, 0))
    for i in range(1900):
        progress.add(i, i % 10 != 0, {"custom_id": f"q{i}", "answer": "x" * 2600})
    assert progress_path(path, 0).stat().st_size > 5_000_000
    await desk.refresh(running)  # the first reconcile reads it all
    for i in range(1900, 1910):
        progress.add(i, True, {"custom_id": f"q{i}", "answer": "x" * 2600})
    before = _bytes_read()
    await desk.refresh(running)
    assert _bytes_read() - before < 200_000  # the ten records, the batch's record
    counts = desk.get(view.id, ME).request_counts
    assert (counts.completed, counts.failed) == (1910 - 190, 190)
    for i in range(1910, 2000):
        progress.add(i, True, {"custom_id": f"q{i}"})
    progress.close()
    await desk.refresh(running)
    done = desk.get(view.id, ME)
    assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 2000 - 190
    assert slurm.cancelled == [view.job_id]  # its task had nothing left to do


_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _OPENED is not None:
        _OPENED.append(str(args[0]))


@contextmanager
def _opened() -> Iterator[list[str]]:
    """The files this process opens meanwhile (Python's ``open`` audit event)."""
    global _OPENED
    if not getattr(sys, "_xhpc_test_audit", False):
        sys.addaudithook(_audit)  # stays for the process; inert outside this block
        sys._xhpc_test_audit = True  # type: ignore[attr-defined]
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


@pytest.mark.adversarial
async def test_a_reconcile_opens_no_file_of_an_ended_batch(site: XhpcConfig) -> None:
    """Failed on 6d94085 before the fix: every reconcile opened and parsed the record of every
    batch in the state directory, however long ago it ended (12 ended batches: 12 files opened
    per reconcile)."""
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    ended = []
    for n in range(12):
        view = await desk.create(batch(desk, request_line(f"e{n}"), model="m"), ME)
        await desk.cancel(view.id, ME)
        ended.append(view.id)
    live = await desk.create(batch(desk, request_line("live"), model="m"), ME)
    running = [listed(str(live.job_id), 0, "RUNNING")]
    await desk.refresh(running)  # the cancelled ones end
    assert {desk.get(b, ME).status for b in ended} == {BatchStatus.CANCELLED}
    root = site.resolved_state_dir / "batches"
    for reconcile in (desk, BatchDesk(site, slurm, "b0", "me")):  # type: ignore[arg-type]
        await reconcile.refresh(running)  # a restarted broker: learns which ended, once
        with _opened() as opened:
            await reconcile.refresh(running)
        ours = [p for p in opened if p.startswith(str(root))]
        assert all(p.startswith(str(root / live.id)) for p in ours), ours
        assert not any("shards" in p for p in ours)  # no progress file of any batch
    with _opened() as opened:  # the hook sees what is opened there
        (root / live.id / "state.json").read_text()
    assert opened


@pytest.mark.adversarial
async def test_listing_batches_reads_no_record_again_and_takes_a_limit(site: XhpcConfig) -> None:
    """Failed on bbd2083 before the fix: every list call and every reconcile read and parsed the
    record of every batch in the state directory (a flood of cancelled batches slowed the
    broker's health answers tenfold); a list returned all of them."""
    slurm = Slurm()
    desk = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    made = []
    for n in range(15):
        view = await desk.create(batch(desk, request_line(f"l{n}"), model="m"), ME)
        await desk.cancel(view.id, ME)
        made.append(view.id)
    await desk.refresh([])
    root = site.resolved_state_dir / "batches"
    with _opened() as opened:
        listed_ = desk.all(ME, limit=5)
        everything = desk.all(ME)
        await desk.refresh([])
    assert [p for p in opened if p.startswith(str(root))] == []
    assert len(listed_) == 5 and len(everything) == 15
    assert {v.id for v in listed_} <= set(made)
    assert [v.created_at for v in everything] == sorted(
        (v.created_at for v in everything), reverse=True
    )
    restarted = BatchDesk(site, slurm, "b0", "me")  # type: ignore[arg-type]
    assert {v.id for v in restarted.all(ME)} == set(made)  # read from disk once, all there
