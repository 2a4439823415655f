"""Pulls into the shared model store (``xhpc cache pull MODEL --from DIR``): the broker checks the
request, submits a short Slurm job (``xhpc/templates/cache.sbatch.j2``, action ``pull``, which
runs ``xhpc.agent.pull``) and records the copy in the ledger once the job reports.

Each pull lives in ``<state_dir>/cache/`` as files, so a restarted broker carries on: its
record ``pull-<id>.json`` (a :class:`xhpc.weights.PullView`, rewritten whole), its script
``pull-<id>.sbatch``, the job's output ``pull-<id>-<job>.out`` and the job's result
``pull-<id>.result.json`` (:class:`xhpc.weights.PullResult`). No listener: at each reconcile the
broker reads the result of every pull still submitted; a result with a copy is recorded in the
ledger (the shared copy: path, size, digest) and the pull is done; one with an error fails it; a
job gone from Slurm's listing without a result (killed, past its time) fails it after a grace.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError as PydanticValidationError

from xhpc.broker.admit.job_policy import JobShape, policy_problems
from xhpc.broker.batches.batch_desk import LIVE_STATES  # a job that has not ended
from xhpc.clock import monotonic, utcnow
from xhpc.errors import AdmissionError, NotFoundError, ValidationError, XhpcError
from xhpc.models import JobInfo
from xhpc.render import CacheSbatchParams, render_cache_sbatch
from xhpc.settings import XhpcConfig
from xhpc.slurm.client import SlurmClient
from xhpc.store.cache import CacheLedger
from xhpc.weights import CachePull, PullResult, PullStatus, PullView

log = logging.getLogger(__name__)

PULL_PREFIX = "xhpc-cache:"  # the --comment of the cache's jobs (as evictions'; not a replica tag)
GONE_GRACE_S = 10.0  # a job missing from the listing this long, with no result, has ended
MAX_RESULT_BYTES = 64 * 1024
_RECORD = re.compile(r"pull-([0-9a-f]{8})\.json")


def check_source(source: Path) -> None:
    """ValidationError unless ``source`` is a real directory (no symlink) with a config.json."""
    try:
        mode = os.lstat(source).st_mode
    except OSError as err:
        raise ValidationError(f"--from {source}: no such directory ({err.strerror})") from err
    if stat.S_ISLNK(mode):
        raise ValidationError(f"--from {source} is a symlink: give the directory it points to")
    if not stat.S_ISDIR(mode):
        raise ValidationError(f"--from {source} is not a directory")
    try:
        config_mode = os.lstat(source / "config.json").st_mode
    except OSError:
        config_mode = 0
    if not stat.S_ISREG(config_mode):
        raise ValidationError(
            f"--from {source} has no config.json: not a Hugging Face-format model directory"
        )


async def submit_cache_job(slurm: SlurmClient, script: Path, params: CacheSbatchParams) -> str:
    """Write a weights-cache job's script (owner-only) and submit it; its job id."""
    script.write_text(render_cache_sbatch(params))
    script.chmod(0o600)
    return await slurm.submit(script)


class PullDesk:
    def __init__(
        self,
        config: XhpcConfig,
        slurm: SlurmClient,
        ledger: CacheLedger,
        broker_id: str,
        python: str,
    ) -> None:
        self.config = config
        self.slurm = slurm
        self.ledger = ledger
        self.broker_id = broker_id
        self.agent_python = python
        self._gone_since: dict[str, float] = {}
        self._ended: set[str] = set()  # pulls done or failed: their records are not read again

    @property
    def jobs_dir(self) -> Path:
        return self.config.resolved_state_dir / "cache"

    def _record(self, pull_id: str) -> Path:
        return self.jobs_dir / f"pull-{pull_id}.json"

    def _result(self, pull_id: str) -> Path:
        return self.jobs_dir / f"pull-{pull_id}.result.json"

    def _save(self, view: PullView) -> None:
        path = self._record(view.id)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(view.model_dump_json())
        tmp.chmod(0o600)
        tmp.replace(path)

    # -- submit ---------------------------------------------------------------------------------
    def _destination(self, req: CachePull) -> Path:
        models_dir = self.config.models_dir
        if models_dir is None:
            raise XhpcError(
                "the site's shared model store (models_dir) is not set: nowhere to pull to",
                hint="set models_dir in the site config",
            )
        dest = models_dir / req.model
        entry = self.config.models.get(req.model)
        expected = entry.weights_path(models_dir) if entry is not None else None
        if expected is not None and expected != dest:
            raise ValidationError(
                f"catalog model {req.model!r} loads its weights from {expected}, "
                f"not {dest}: pull under the name that path gives, or copy it there"
            )
        return dest

    async def submit(self, req: CachePull) -> PullView:
        """Check the request (nothing is submitted when a check fails), then submit the job."""
        dest = self._destination(req)
        check_source(Path(req.source))
        shape = JobShape(what="the pull", gpus=0, time=self.config.slurm.default_time)
        problems = policy_problems(shape, self.config)
        if problems:
            raise AdmissionError(problems)
        busy = [v for v in self.views(open_only=True) if v.model == req.model]
        if busy:
            raise ValidationError(
                f"a pull of {req.model} is in progress (job {busy[0].job_id}): wait for it to end"
            )
        self.jobs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        pull_id = secrets.token_hex(4)
        args = [req.source, str(dest.parent), req.model, str(self._result(pull_id))]
        params = CacheSbatchParams(
            job_name=f"xhpc-cache-pull-{req.model}",
            comment=f"{PULL_PREFIX}{self.broker_id}:pull-{pull_id}",
            action="pull",
            args=(*args, *(["--replace"] if req.replace else [])),
            partition=self.config.slurm.partition,
            account=self.config.slurm.account,
            time=self.config.slurm.default_time,
            output=str(self.jobs_dir / f"pull-{pull_id}-%j.out"),
            agent_python=self.agent_python,
        )
        job_id = await submit_cache_job(
            self.slurm, self.jobs_dir / f"pull-{pull_id}.sbatch", params
        )
        view = PullView(
            id=pull_id,
            model=req.model,
            source=req.source,
            path=str(dest),
            replace=req.replace,
            job_id=job_id,
            submitted_at=utcnow(),
            output=str(self.jobs_dir / f"pull-{pull_id}-{job_id}.out"),
        )
        self._save(view)
        log.info("cache: job %s pulls %s into %s", job_id, req.source, dest)
        return view

    # -- reads ----------------------------------------------------------------------------------
    def view(self, pull_id: str) -> PullView:
        path = self._record(pull_id)
        if _RECORD.fullmatch(path.name) is None or not path.is_file():
            raise NotFoundError(f"no pull {pull_id!r}")
        return PullView.model_validate_json(path.read_text())

    def views(self, *, open_only: bool = False) -> list[PullView]:
        """Every pull, oldest first (``open_only``: those whose job has not reported)."""
        if not self.jobs_dir.is_dir():
            return []
        found = [m.group(1) for p in self.jobs_dir.iterdir() if (m := _RECORD.fullmatch(p.name))]
        if open_only:
            found = [i for i in found if i not in self._ended]
        views = []
        for pull_id in found:
            try:
                views.append(self.view(pull_id))
            except (OSError, PydanticValidationError) as err:  # a record cut short: skipped
                log.warning("cache: pull record %s unreadable: %s", pull_id, err)
                self._ended.add(pull_id)
        self._ended.update(v.id for v in views if v.status is not PullStatus.SUBMITTED)
        if open_only:
            views = [v for v in views if v.status is PullStatus.SUBMITTED]
        return sorted(views, key=lambda v: v.submitted_at)

    # -- the jobs' reports ----------------------------------------------------------------------
    async def refresh(self, jobs: Sequence[JobInfo]) -> None:
        """Settle every submitted pull whose job reported or ended, on this listing of jobs."""
        live = {j.job_id for j in jobs if j.state.upper() in LIVE_STATES}
        for view in self.views(open_only=True):
            result = self._read_result(view)
            if result is not None:
                self._settle(view, result)
            elif view.job_id in live:
                self._gone_since.pop(view.id, None)
            elif monotonic() - self._gone_since.setdefault(view.id, monotonic()) >= GONE_GRACE_S:
                why = f"job {view.job_id} ended without a result: see {view.output}"
                self._end(view, PullStatus.FAILED, error=why)

    def _read_result(self, view: PullView) -> PullResult | None:
        path = self._result(view.id)
        try:
            with path.open("rb") as fh:
                raw = fh.read(MAX_RESULT_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            if len(raw) > MAX_RESULT_BYTES:
                raise ValueError("too large")
            return PullResult.model_validate_json(raw)
        except (PydanticValidationError, ValueError) as err:
            return PullResult(model=view.model, path=view.path, error=f"unreadable result: {err}")

    def _settle(self, view: PullView, result: PullResult) -> None:
        if result.error is not None:
            self._end(view, PullStatus.FAILED, error=result.error)
            return
        if (result.model, result.path) != (view.model, view.path) or result.digest is None:
            self._end(view, PullStatus.FAILED, error="the job reported another copy than asked")
            return
        if not Path(result.path).is_dir():
            self._end(view, PullStatus.FAILED, error=f"the job reported {result.path}: not there")
            return
        self.ledger.record(view.model, None, result.path, result.size_bytes, result.digest)
        log.info("cache: pulled %s into %s (%s)", view.model, result.path, result.digest)
        self._end(
            view,
            PullStatus.DONE,
            recorded=self.ledger.shared(view.model),
            unchanged=result.unchanged,
            replaced=result.replaced,
        )

    def _end(self, view: PullView, status: PullStatus, **fields: object) -> None:
        if status is PullStatus.FAILED:
            log.warning("cache: pull of %s failed: %s", view.model, fields.get("error"))
        self._gone_since.pop(view.id, None)
        self._save(view.model_copy(update={"status": status, "ended_at": utcnow(), **fields}))
