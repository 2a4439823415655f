"""Batches: the OpenAI Batch API run as Slurm job arrays, one shard per array task.

A batch lives in its own owner-only directory under ``<state_dir>/batches/``: its input (copied
when it was created), its spec for the tasks, the broker's record of it (``state.json``: status,
job, times, requeues), each shard's progress file (the tasks' checkpoints, ``xhpc.batch.lines``)
and, once it ended, the output and error files. Counts come from the progress files, so they
are right whichever broker or task wrote them. Each reconcile looks at the arrays of the batches
in progress: a batch whose lines are all answered is finalized (output and error files in
input order); an array with no task left in Slurm while lines are unanswered (a task killed,
failed, or past its time limit) has those shards' tasks requeued, up to ``MAX_REQUEUES`` each,
after which the batch fails with what it has. Cancelling cancels the array and finalizes what
was answered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from xhpc.access import MAX_COUNT, Caller, JobCharge, ModelAccess, UsageCount, check_owner
from xhpc.batch.lines import (
    Progress,
    ProgressFile,
    ProgressReader,
    answered_usage,
    assemble,
    duplicate_ids,
    read_lines,
    read_progress,
    shard_range,
)
from xhpc.batch.send import Target, answer_all, unanswered
from xhpc.batch.spec import (
    ENDED,
    ERROR_FILE,
    INPUT_FILE,
    OUTPUT_FILE,
    SPEC_FILE,
    STATE_FILE,
    BatchRequest,
    BatchSpec,
    BatchStatus,
    BatchView,
    RequestCounts,
    progress_path,
)
from xhpc.broker.admit.job_policy import JobShape, policy_problems
from xhpc.broker.batches.batch_inputs import BatchInputs
from xhpc.broker.batches.batch_models import batch_model, check_online
from xhpc.clock import monotonic, utcnow
from xhpc.errors import AdmissionError, NotFoundError, SlurmError, ValidationError, XhpcError
from xhpc.ids import IdKind, new_batch_id, valid
from xhpc.models import EngineKind, JobInfo, RoutingTable
from xhpc.records import DeploymentRecord
from xhpc.render import BatchSbatchParams, render_batch_sbatch
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient

log = logging.getLogger(__name__)

MAX_REQUEUES = 3  # per shard, after its task ended with lines left
SETTLE_S = 10.0  # after a submit or a requeue, Slurm's listing may not show the tasks yet
BATCH_PREFIX = "xhpc-batch:"
# A task that has not ended: Slurm still has it pending, running or about to run again.
LIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                         "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
                         "STAGE_OUT", "STOPPED"})  # fmt: skip


def batch_tag(broker_id: str, batch_id: str) -> str:
    """The array's ``--comment`` (not a replica, pilot or unit tag: the sweep leaves it be)."""
    return f"{BATCH_PREFIX}{broker_id}:{batch_id}"


def _now() -> int:
    return int(utcnow().timestamp())


class BatchDesk:
    def __init__(
        self,
        config: XhpcConfig,
        slurm: SlurmClient,
        broker_id: str,
        user: str,
        routes: Callable[[], RoutingTable] = RoutingTable,
        access: Callable[[], Sequence[ModelAccess]] = tuple,
        deployment: Callable[[str], DeploymentRecord | None] = lambda _: None,
        record_usage: Callable[[Mapping[str, Mapping[str, UsageCount]]], None] | None = None,
    ) -> None:
        """``routes``: the READY replicas (online batches); ``access``: the live deployments'
        owners and accounts; ``deployment``: a live deployment's record by name;
        ``record_usage``: adds to keys' usage (``Keys.add_usage``)."""
        self.config = config
        self.slurm = slurm
        self.broker_id = broker_id
        self.user = user  # the broker's own user: the owner of batches made by internal calls
        self.root = config.resolved_state_dir / "batches"
        broker = config.broker
        self.inputs = BatchInputs(
            config.resolved_state_dir / "batch-inputs",
            broker.batch_input_max_bytes,
            broker.batch_input_max_lines,
        )
        self.python = sys.executable
        self._settled_at: dict[str, float] = {}  # batch -> when its tasks should be listed
        self.routes = routes
        self.access = access
        self.deployment = deployment
        self.record_usage = record_usage
        # Online batches being sent by this broker: the task, and its stop between answers.
        self._online: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}
        # Progress read so far: each shard's reader of a batch in progress (each reconcile reads
        # what was appended since), the counts of ended batches (final: read once), and the
        # batches known to have ended (a reconcile skips them unread).
        self._readers: dict[str, list[ProgressReader]] = {}
        self._final: dict[str, RequestCounts] = {}
        self._ended: set[str] = set()
        # Every batch's record, read from its state.json once (this broker is the only writer
        # of its state directory: each save updates it); None until the first scan.
        self._views: dict[str, BatchView] | None = None

    # -- files ------------------------------------------------------------------------------
    def _dir(self, batch_id: str) -> Path:
        if not valid(IdKind.BATCH, batch_id):
            raise NotFoundError(f"no batch {batch_id[:80]!r}")
        if batch_id not in self._known():
            raise NotFoundError(f"no batch {batch_id!r}")
        return self.root / batch_id

    def _known(self) -> dict[str, BatchView]:
        """Every batch's record by id: the state directory scanned once, then kept."""
        if self._views is None:
            views: dict[str, BatchView] = {}
            if self.root.is_dir():
                for path in sorted(self.root.iterdir()):
                    if valid(IdKind.BATCH, path.name) and (path / STATE_FILE).is_file():
                        views[path.name] = BatchView.model_validate_json(
                            (path / STATE_FILE).read_text()
                        )
            self._views = views
        return self._views

    def _record(self, path: Path) -> BatchView:
        view = self._known().get(path.name)
        if view is None:
            view = BatchView.model_validate_json((path / STATE_FILE).read_text())
            self._known()[path.name] = view
        return view

    def _save(self, path: Path, view: BatchView) -> None:
        tmp = path / f".{STATE_FILE}.{secrets.token_hex(4)}"
        # The total is the input's, kept from creation; the rest is read from the progress files.
        stored = view.model_copy(
            update={"request_counts": RequestCounts(total=view.request_counts.total)}
        )
        tmp.write_text(stored.model_dump_json(exclude={"request_counts": {"completed", "failed"}}))
        os.replace(tmp, path / STATE_FILE)
        self._known()[path.name] = stored

    def _progress(self, path: Path, view: BatchView) -> list[Progress]:
        """Its shards' progress: a batch in progress is read where the last read stopped (its
        readers kept); an ended one whole, once (its counts are kept)."""
        if view.status in ENDED:
            return [read_progress(progress_path(path, shard)) for shard in range(view.shards)]
        readers = self._readers.get(view.id)
        if readers is None or len(readers) != view.shards:
            readers = [ProgressReader(progress_path(path, s)) for s in range(view.shards)]
            self._readers[view.id] = readers
        return [reader.read() for reader in readers]

    def _counted(
        self, path: Path, view: BatchView, progress: list[Progress] | None = None
    ) -> BatchView:
        """``view`` with its counts: the answered lines from the shards' progress files."""
        counts = self._final.get(view.id) if view.status in ENDED else None
        if counts is None:
            shards = self._progress(path, view) if progress is None else progress
            counts = RequestCounts(
                total=view.request_counts.total,
                completed=sum(p.completed for p in shards),
                failed=sum(p.failed for p in shards),
            )
            if view.status in ENDED:
                self._final[view.id] = counts  # no task writes to an ended batch's files
        return view.model_copy(update={"request_counts": counts})

    # -- the API ----------------------------------------------------------------------------
    async def create(self, req: BatchRequest, caller: Caller | None) -> BatchView:
        """A batch of ``req.input_id`` (the caller's upload, moved into the batch)."""
        if not req.endpoint_ok():
            raise ValidationError(f"unsupported endpoint {req.endpoint!r}")
        if req.online:
            return await self._create_online(req, caller)
        shape = JobShape(what="the batch", gpus=req.gpus, time=req.time,
                         partition=req.partition, qos=req.qos, tasks=req.shards)  # fmt: skip
        problems = policy_problems(shape, self.config)
        if problems:
            raise AdmissionError(problems)
        model = batch_model(req.model, caller, self.config, self._access(), self.deployment)
        source = self.inputs.path(self._owner(caller), req.input_id)
        lines = await asyncio.to_thread(self._lines, req, source)
        try:
            engine = EngineKind(req.engine) if req.engine else None
        except ValueError as err:
            raise ValidationError(f"unknown engine {req.engine!r}") from err
        engine = engine or model.engine or self.config.default_engine
        shards = min(req.shards, len(lines))
        batch_id = new_batch_id()
        path = self.root / batch_id
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        try:
            os.replace(source, path / INPUT_FILE)
            return await self._submit(path, batch_id, req, len(lines), model.path, model.name,
                                      engine, shards, caller)  # fmt: skip
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # no partial batch
            self._known().pop(batch_id, None)
            raise

    async def _submit(
        self, path: Path, batch_id: str, req: BatchRequest, total: int, model_path: Path,
        served: str, engine: EngineKind, shards: int, caller: Caller | None,
    ) -> BatchView:  # fmt: skip
        (path / "shards").mkdir(mode=0o700)
        spec = BatchSpec(
            batch_id=batch_id, endpoint=req.endpoint, model_path=str(model_path),
            served_model=served, engine=engine.value, gpus=req.gpus, shards=shards,
            concurrency=req.concurrency, python=self.python,
            startup_timeout_s=self.config.engine(engine).startup_timeout_s,
        )  # fmt: skip
        (path / SPEC_FILE).write_text(spec.model_dump_json())
        params = BatchSbatchParams(
            batch_id=batch_id, job_name=f"xhpc-batch-{batch_id[6:14]}",
            comment=batch_tag(self.broker_id, batch_id), last_task=shards - 1, gpus=req.gpus,
            cpus=self.config.slurm.cpus_per_replica,
            partition=req.partition or self.config.slurm.partition, qos=req.qos,
            account=self.config.slurm.account, time=req.time,
            output=str(path / "slurm-%A_%a.out"), python=self.python, batch_dir=str(path),
        )  # fmt: skip
        try:
            script_text = render_batch_sbatch(params)
        except ValueError as err:
            raise ValidationError(str(err)) from err
        script = path / "job.sbatch"
        script.write_text(script_text)
        view = BatchView(
            id=batch_id, endpoint=req.endpoint, model=served, status=BatchStatus.VALIDATING,
            created_at=_now(), owner=self._owner(caller), shards=shards,
            metadata=req.metadata, request_counts=RequestCounts(total=total),
            key_id=caller.key_id if caller is not None else None,
        )  # fmt: skip
        self._save(path, view)
        job_id = await self.slurm.submit(script)
        view = view.model_copy(update={"job_id": job_id, "status": BatchStatus.IN_PROGRESS})
        self._save(path, view)
        self._settled_at[batch_id] = monotonic() + SETTLE_S
        log.info("batch %s: %d lines in %d shards, array job %s", batch_id, total,
                 shards, job_id)  # fmt: skip
        return self._counted(path, view)

    def _lines(self, req: BatchRequest, source: Path) -> list[str]:
        """The input's lines, refused when they cannot make a batch (in a thread)."""
        lines = read_lines(source)
        if not lines:
            raise ValidationError("the input file holds no requests")
        dups = duplicate_ids(lines, req.endpoint)
        if dups:
            shown = ", ".join(repr(d) for d in dups[:5])
            raise ValidationError(f"custom_id must be unique in a batch; repeated: {shown}")
        return lines

    def _access(self) -> Mapping[str, ModelAccess]:
        return {a.model: a for a in self.access()}

    def _targets(self, deployment: str) -> list[Target]:
        return [
            (r.url, r.secret, r.served_model)
            for r in self.routes().routes
            if r.model == deployment and r.role is None
        ]

    async def _create_online(self, req: BatchRequest, caller: Caller | None) -> BatchView:
        """A batch sent to deployment ``req.model``'s READY replicas by the broker itself."""
        check_online(req.model, caller, self._access())
        source = self.inputs.path(self._owner(caller), req.input_id)
        lines = await asyncio.to_thread(self._lines, req, source)
        if not self._targets(req.model):
            raise ValidationError(
                f"deployment {req.model!r} has no READY replica to send the batch to",
                hint=f"xhpc serve {req.model} first, or submit without --online",
            )
        batch_id = new_batch_id()
        path = self.root / batch_id
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        (path / "shards").mkdir(mode=0o700)
        os.replace(source, path / INPUT_FILE)
        spec = BatchSpec(
            batch_id=batch_id, endpoint=req.endpoint, model_path="", served_model=req.model,
            engine="", gpus=0, shards=1, concurrency=req.concurrency, python=self.python,
        )  # fmt: skip
        (path / SPEC_FILE).write_text(spec.model_dump_json())
        view = BatchView(
            id=batch_id, endpoint=req.endpoint, model=req.model, status=BatchStatus.IN_PROGRESS,
            created_at=_now(), owner=self._owner(caller), metadata=req.metadata,
            online=True, request_counts=RequestCounts(total=len(lines)),
            key_id=caller.key_id if caller is not None else None,
        )  # fmt: skip
        self._save(path, view)
        self._start_online(path, spec)
        return self._counted(path, view)

    def _start_online(self, path: Path, spec: BatchSpec) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(self._send_online(path, spec, stop))
        self._online[spec.batch_id] = (task, stop)

    async def _send_online(self, path: Path, spec: BatchSpec, stop: asyncio.Event) -> None:
        progress = ProgressFile(progress_path(path, 0))
        try:
            lines = read_lines(path / INPUT_FILE)
            todo = unanswered(lines, range(len(lines)), spec, progress)
            targets = self._targets(spec.served_model)
            if todo and not targets:
                raise XhpcError(f"deployment {spec.served_model!r} has no READY replica")
            sent = path / "shards" / "0.sent"
            await answer_all(todo, targets, progress, spec, stop, sent)
        except (XhpcError, OSError, aiohttp.ClientError, TimeoutError) as err:
            log.warning("batch %s: sending stopped: %s", spec.batch_id, err)
        finally:
            progress.close()

    def _owner(self, caller: Caller | None) -> str:
        """The caller (the gateway's calls act as the key's user: xhpc.broker.api)."""
        return caller.user if caller is not None else self.user

    def _mine(self, batch_id: str, caller: Caller | None) -> tuple[Path, BatchView]:
        """The caller's batch ``batch_id`` (admins: anyone's). Another user's batch is, to the
        caller, one that does not exist: the answer says neither that it exists nor whose it
        is."""
        path = self._dir(batch_id)
        view = self._record(path)
        try:
            check_owner(caller, view.owner, f"batch {batch_id}")
        except PermissionError:
            raise NotFoundError(f"no batch {batch_id!r}") from None
        return path, view

    def get(self, batch_id: str, caller: Caller | None) -> BatchView:
        path, view = self._mine(batch_id, caller)
        return self._counted(path, view)

    def all(self, caller: Caller | None, limit: int | None = None) -> list[BatchView]:
        """The caller's batches (admins: all), newest first; ``limit``: at most that many."""
        mine = [
            view for view in self._known().values()
            if caller is None or caller.admin or view.owner == caller.user
        ]  # fmt: skip
        mine.sort(key=lambda v: (v.created_at, v.id), reverse=True)
        return [self._counted(self.root / v.id, v) for v in mine[:limit]]

    def charges(self) -> list[JobCharge]:
        """Each job-array batch's array as a run for `xhpc usage`'s GPU-hours: charged to the
        batch's owner (the key's user) and model, as a deployment's jobs are."""
        out = []
        for view in self._known().values():
            if view.job_id is None:
                continue  # online: the deployment's own jobs are charged
            ended = view.completed_at or view.cancelled_at or view.created_at
            out.append(
                JobCharge(
                    run=f"batch-{view.id}",
                    job_id=view.job_id,
                    model=view.model,
                    owner=view.owner,
                    submitted_at=datetime.fromtimestamp(view.created_at, UTC),
                    ended_at=datetime.fromtimestamp(ended, UTC) if view.status in ENDED else None,
                )
            )
        return out

    def output(self, batch_id: str, caller: Caller | None, errors: bool = False) -> str:
        view = self.get(batch_id, caller)
        name = view.error_file if errors else view.output_file
        if name is None:
            raise ValidationError(f"batch {batch_id} is {view.status.value}: no results yet")
        return Path(name).read_text()

    async def cancel(self, batch_id: str, caller: Caller | None) -> BatchView:
        path, view = self._mine(batch_id, caller)
        if view.status in ENDED or view.status is BatchStatus.CANCELLING:
            return self._counted(path, view)
        if view.job_id:
            await self.slurm.cancel([view.job_id])
        running = self._online.get(batch_id)
        if running is not None:
            running[1].set()  # between answers: what was answered is kept
        view = view.model_copy(update={"status": BatchStatus.CANCELLING, "cancelled_at": _now()})
        self._save(path, view)
        return self._counted(path, view)

    # -- the reconcile's part ---------------------------------------------------------------
    async def refresh(self, jobs: Sequence[JobInfo]) -> None:
        """Advance every batch in progress on this listing of Slurm's jobs (an ended batch is
        not read: its record once, to learn it ended; its progress never)."""
        for view in list(self._known().values()):
            if view.id in self._ended:
                continue
            if view.status in ENDED:
                self._ended_now(view.id)
                continue
            path = self.root / view.id
            try:
                if view.online:
                    self._advance_online(path, view)
                elif view.job_id is not None:
                    await self._advance(path, view, jobs)
            except SlurmError as err:
                log.warning("batch %s: %s", view.id, err.one_line())

    async def _advance(self, path: Path, view: BatchView, jobs: Sequence[JobInfo]) -> None:
        array = int(str(view.job_id))
        tasks = [j for j in jobs if j.array_job_id == array or j.raw_job_id == array]
        live = [t for t in tasks if t.state.upper() in LIVE_STATES]
        progress = self._progress(path, view)  # read once for the counts and the requeues
        counts = self._counted(path, view, progress).request_counts
        if view.status is BatchStatus.CANCELLING:
            if not live:
                self._finish(path, view, BatchStatus.CANCELLED)
            return
        if counts.completed + counts.failed >= counts.total:
            if live:
                await self.slurm.cancel([str(view.job_id)])  # tasks with nothing left to do
            self._finish(path, view, BatchStatus.COMPLETED)
            return
        if live or monotonic() < self._settled_at.get(view.id, 0.0):
            return
        # No task is left in Slurm, yet lines are unanswered: requeue those shards' tasks.
        total = counts.total
        lacking = [
            shard for shard in range(view.shards)
            if len(progress[shard].done) < len(shard_range(total, view.shards, shard))
        ]  # fmt: skip
        spent = [s for s in lacking if view.requeues.get(str(s), 0) >= MAX_REQUEUES]
        if spent:
            why = f"shard(s) {', '.join(map(str, spent))} ended {MAX_REQUEUES + 1} times unfinished"
            self._finish(path, view.model_copy(update={"errors": [why]}), BatchStatus.FAILED)
            return
        await self.slurm.requeue([f"{array}_{s}" for s in lacking])
        requeues = {**view.requeues, **{str(s): view.requeues.get(str(s), 0) + 1 for s in lacking}}
        self._save(path, view.model_copy(update={"requeues": requeues}))
        self._settled_at[view.id] = monotonic() + SETTLE_S
        log.info("batch %s: requeued shard(s) %s", view.id, lacking)

    def _advance_online(self, path: Path, view: BatchView) -> None:
        running = self._online.get(view.id)
        sending = running is not None and not running[0].done()
        counts = self._counted(path, view).request_counts
        if view.status is BatchStatus.CANCELLING:
            if not sending:
                self._finish(path, view, BatchStatus.CANCELLED)
            return
        if counts.completed + counts.failed >= counts.total:
            self._finish(path, view, BatchStatus.COMPLETED)
            return
        if sending:
            return
        # Its sender ended with lines left (replicas gone, a broker restart): start it again.
        tries = view.requeues.get("0", 0)
        if tries >= MAX_REQUEUES:
            why = f"sending stopped {MAX_REQUEUES + 1} times with lines unanswered"
            self._finish(path, view.model_copy(update={"errors": [why]}), BatchStatus.FAILED)
            return
        self._save(path, view.model_copy(update={"requeues": {"0": tries + 1}}))
        spec = BatchSpec.model_validate_json((path / SPEC_FILE).read_text())
        self._start_online(path, spec)

    def _finish(self, path: Path, view: BatchView, status: BatchStatus) -> None:
        shards = [progress_path(path, s) for s in range(view.shards)]
        assemble(shards, path / OUTPUT_FILE, path / ERROR_FILE)
        done = view.model_copy(
            update={
                "status": status,
                "completed_at": _now() if status is BatchStatus.COMPLETED else view.completed_at,
                "output_file": str(path / OUTPUT_FILE),
                "error_file": str(path / ERROR_FILE),
            }
        )
        self._save(path, done)
        self._ended_now(view.id)
        log.info("batch %s: %s", view.id, status.value)
        # The tokens its answers used, for the key that made it (as the gateway counts a
        # request's: its quota and `xhpc usage` see them).
        record = self.record_usage
        if view.key_id is not None and record is not None:
            record({view.key_id: {view.model: _usage(path)}})

    def _ended_now(self, batch_id: str) -> None:
        self._ended.add(batch_id)
        self._readers.pop(batch_id, None)


def _usage(path: Path) -> UsageCount:
    requests, prompt, completion = answered_usage(path / OUTPUT_FILE, path / ERROR_FILE)
    return UsageCount(
        requests=min(requests, MAX_COUNT),
        prompt_tokens=min(prompt, MAX_COUNT),
        completion_tokens=min(completion, MAX_COUNT),
    )
