"""The Slurm client interface and its default backend, the Slurm CLI.

Other backends (pyslurm, slurmrestd) can implement ``SlurmClient`` later.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from xhpc import runner
from xhpc.access import JobUsage
from xhpc.clock import monotonic
from xhpc.errors import SlurmError, SlurmParseError, SlurmTimeoutError
from xhpc.models import JobInfo, NodeInfo, PartitionInfo, StartEstimate
from xhpc.settings import SlurmConfig
from xhpc.slurm import argv as A
from xhpc.slurm.details import parse_job_details
from xhpc.slurm.estimate import TEST_ONLY_TIME_FORMAT, parse_test_only
from xhpc.slurm.parse import parse_sbatch_parsable, parse_sinfo_json, parse_squeue_json
from xhpc.slurm.partitions import (
    parse_partitions,
    parse_scontrol_config,
    parse_topology,
    parse_user_accounts,
)
from xhpc.slurm.sacct import SACCT_FIELDS, SACCT_TIME_FORMAT, batches, parse_sacct_usage
from xhpc.slurm.text import (
    SINFO_FIELDS,
    SQUEUE_ENV,
    SQUEUE_FIELDS,
    SinfoReader,
    SqueueReader,
    format_option,
)

Timed = Callable[[str, float, bool], None]
"""Told of each command the client ran: what (``sbatch``, ``squeue``...), its seconds, whether
it succeeded."""

# Up to this many jobs whose GPU detail is not known yet: one `scontrol show job ID` each;
# more (the broker's first poll): one `scontrol show job` of all jobs.
DETAIL_ONE_BY_ONE = 16


class SlurmClient(Protocol):
    async def nodes(self) -> list[NodeInfo]: ...

    async def jobs(self, job_ids: Sequence[str] = ()) -> list[JobInfo]: ...

    async def submit(self, script: Path) -> str: ...

    async def estimate_start(
        self, options: Sequence[str], partition: str | None, node: str
    ) -> StartEstimate: ...

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None: ...

    async def requeue(self, job_ids: Sequence[str]) -> None: ...

    async def partitions(self) -> list[PartitionInfo]: ...

    async def topology(self) -> dict[str, str]: ...

    async def accounting_storage_type(self) -> str | None: ...

    async def user_accounts(self, user: str) -> list[str]: ...

    async def job_usage(self, job_ids: Sequence[str], user: str) -> list[JobUsage]: ...


class CliSlurmClient:
    """Talks to Slurm through its CLI: narrow `-O` listings (`--json` when one cannot be read
    unambiguously), `--parsable`, argv lists, one chokepoint.

    Keeps the nodes and jobs of its previous listing (:mod:`xhpc.slurm.text`): an unchanged one is
    the same object again, and a job's GPU detail is asked of Slurm once per run of the job.
    ``timed``, when set, is told of every command it runs (the broker's metrics); ``guard``,
    when set, is asked before every command that acts on jobs (sbatch, scancel, requeue): a
    broker that lost its lease is refused there (xhpc.store.lease)."""

    def __init__(self, config: SlurmConfig, timed: Timed | None = None) -> None:
        self.config = config
        self.timed = timed
        self.guard: Callable[[], None] | None = None
        self.env = dict(os.environ)
        if config.conf_path is not None:
            self.env["SLURM_CONF"] = str(config.conf_path)
        self._sinfo = SinfoReader()
        self._squeue = SqueueReader()

    def _guarded(self) -> None:
        if self.guard is not None:
            self.guard()

    async def _run(self, argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
        return (await self._call(argv, what, env)).stdout

    async def _call(
        self, argv: list[str], what: str, env: dict[str, str] | None = None
    ) -> runner.Completed:
        started = monotonic()
        try:
            done = await runner.run(
                argv, timeout_s=self.config.command_timeout_s, env=env or self.env
            )
        except runner.CommandFailed as err:
            if self.timed is not None:
                self.timed(what, monotonic() - started, False)
            cls = SlurmTimeoutError if err.timed_out else SlurmError
            raise cls(
                f"{what} failed ({err.why})",
                argv=err.argv,
                returncode=err.returncode,
                stdout=err.stdout,
                stderr=err.stderr,
            ) from err
        if self.timed is not None:
            self.timed(what, monotonic() - started, True)
        return done

    async def nodes(self) -> list[NodeInfo]:
        bin_dir = self.config.bin_dir
        text = await self._run(A.sinfo_nodes(format_option(SINFO_FIELDS), bin_dir), "sinfo")
        try:
            return self._sinfo.read(text)
        except SlurmParseError:  # a reason with SEP or a line break in it: ask for the JSON
            return parse_sinfo_json(await self._run(A.sinfo_json(bin_dir), "sinfo"))

    async def jobs(self, job_ids: Sequence[str] = ()) -> list[JobInfo]:
        # All jobs (Slurm 22.05 ignores squeue's filters with --json), filtered here.
        bin_dir = self.config.bin_dir
        argv = A.squeue_jobs(format_option(SQUEUE_FIELDS), bin_dir)
        text = await self._run(argv, "squeue", {**self.env, **SQUEUE_ENV})
        try:
            jobs, missing = self._squeue.read(text)
            if missing:
                jobs, _ = self._squeue.read(text, await self._details(missing))
        except SlurmParseError:  # user text with SEP or a line break in it: ask for the JSON
            jobs = parse_squeue_json(await self._run(A.squeue_json(bin_dir), "squeue"))
        if job_ids:
            wanted = set(job_ids)
            jobs = [j for j in jobs if j.job_id in wanted or str(j.raw_job_id) in wanted]
        return jobs

    async def _details(self, job_ids: Sequence[int]) -> dict[int, tuple[str, ...]]:
        """The GPU detail of these jobs (those that ended meanwhile: none)."""
        bin_dir = self.config.bin_dir
        if len(job_ids) > DETAIL_ONE_BY_ONE:
            return parse_job_details(
                await self._run(A.scontrol_show_jobs(None, bin_dir), "scontrol")
            )
        details: dict[int, tuple[str, ...]] = {}
        for job_id in job_ids:
            try:
                out = await self._run(A.scontrol_show_jobs(str(job_id), bin_dir), "scontrol")
            except SlurmError as err:  # gone since squeue listed it ("Invalid job id")
                if isinstance(err, SlurmTimeoutError):
                    raise
                continue
            details.update(parse_job_details(out))
        return details

    async def submit(self, script: Path) -> str:
        self._guarded()
        out = await self._run(A.sbatch_parsable(script, self.config.bin_dir), "sbatch")
        return parse_sbatch_parsable(out)

    async def estimate_start(
        self, options: Sequence[str], partition: str | None, node: str
    ) -> StartEstimate:
        """When Slurm expects a job of this shape (``options``: sbatch's ``--gres``, ``--time``,
        ...) to start on ``node`` in ``partition`` (``sbatch --test-only``: nothing submitted).
        SlurmError when it never could (the node is not in the partition, too few GPUs)."""
        argv = A.sbatch_test_only(options, partition, node, self.config.bin_dir)
        env = {**self.env, "SLURM_TIME_FORMAT": TEST_ONLY_TIME_FORMAT}
        done = await self._call(argv, "sbatch --test-only", env)
        return parse_test_only(done.stderr)

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None:
        if job_ids:
            self._guarded()
            await self._run(A.scancel(job_ids, self.config.bin_dir, signal), "scancel")

    async def requeue(self, job_ids: Sequence[str]) -> None:
        """Requeue jobs or array tasks (``ARRAY_TASK``) that ended: they run again."""
        if job_ids:
            self._guarded()
            await self._run(A.scontrol_requeue(job_ids, self.config.bin_dir), "scontrol requeue")

    async def partitions(self) -> list[PartitionInfo]:
        """Every partition (hidden ones too) with its limits; changes rarely: poll seldom."""
        argv = A.scontrol_show_partitions(self.config.bin_dir)
        return parse_partitions(await self._run(argv, "scontrol show partition"))

    async def topology(self) -> dict[str, str]:
        """Each leaf switch of Slurm's tree topology and its nodes (a hostlist); {} without one.
        Changes only with slurmctld's configuration: read it seldom."""
        argv = A.scontrol_show_topology(self.config.bin_dir)
        return parse_topology(await self._run(argv, "scontrol show topology"))

    async def accounting_storage_type(self) -> str | None:
        """``AccountingStorageType`` (e.g. ``accounting_storage/none``); fixed while slurmctld
        runs, so one call per broker start is enough."""
        argv = A.scontrol_show_config(self.config.bin_dir)
        config = parse_scontrol_config(await self._run(argv, "scontrol show config"))
        return config.get("AccountingStorageType")

    async def user_accounts(self, user: str) -> list[str]:
        """The accounts Slurm accounting lets ``user`` use on this cluster: those of its
        associations with this cluster's ``ClusterName`` ([] when it has none). Only meaningful
        with accounting on (``accounting_storage_type``)."""
        argv = A.scontrol_show_config(self.config.bin_dir)
        config = parse_scontrol_config(await self._run(argv, "scontrol show config"))
        argv = A.sacctmgr_user_associations(user, self.config.bin_dir)
        out = await self._run(argv, "sacctmgr show associations")
        return parse_user_accounts(out, config.get("ClusterName"))

    async def job_usage(self, job_ids: Sequence[str], user: str) -> list[JobUsage]:
        """The accounting records of ``user``'s jobs ``job_ids`` (hetjobs by their leader: every
        component), one `sacct` per batch of ids. Only meaningful with accounting on."""
        env = {**self.env, "SLURM_TIME_FORMAT": SACCT_TIME_FORMAT}
        records: list[JobUsage] = []
        for batch in batches(job_ids):
            argv = A.sacct_usage(batch, user, SACCT_FIELDS, self.config.bin_dir)
            records.extend(parse_sacct_usage(await self._run(argv, "sacct", env)))
        return records

    async def version(self) -> str:
        """Slurm's version as its commands print it (``slurm 22.05.8``)."""
        return (await self._run(A.sinfo_version(self.config.bin_dir), "sinfo --version")).strip()

    async def nodes_json(self) -> list[NodeInfo]:
        """The nodes from ``sinfo --json`` (what the listings fall back to when a node's text
        cannot be read unambiguously); an error when this Slurm has no JSON output."""
        return parse_sinfo_json(await self._run(A.sinfo_json(self.config.bin_dir), "sinfo --json"))

    async def config_values(self) -> dict[str, str]:
        """`scontrol show config` as {key: value}."""
        argv = A.scontrol_show_config(self.config.bin_dir)
        return parse_scontrol_config(await self._run(argv, "scontrol show config"))

    async def accounting_ping(self) -> None:
        """One small `sacct` query: an error when slurmdbd does not answer."""
        await self._run(A.sacct_ping(self.config.bin_dir), "sacct")
