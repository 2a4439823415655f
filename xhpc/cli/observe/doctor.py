"""`xhpc doctor`: checks of the serving plane: orphans (see xhpc.broker.watch.orphans), or the site.

``xhpc doctor`` checks for orphans through the broker (``--orphans`` selects it explicitly).
``xhpc doctor --site`` checks the Slurm site instead, with no broker needed
(xhpc.sitecheck.run): one ``ok|warn|fail NAME WHAT`` line per check, exit 1 when one fails.
Exit status, so that scripts can alert:

- 0: nothing found (with ``--fix``: every orphan found was resolved by an action);
- 1: orphans exist (with ``--fix``: some were only reported, or an action failed);
- 2 and above: xhpc errors, as for every command (broker not running: 4).

Without ``--fix`` nothing changes; the last column previews what ``--fix`` would do.
``--fix`` applies the broker's policy (today's defaults: report unknown jobs, mark replicas whose
job is gone LOST); ``--cancel-unknown-jobs`` / ``--adopt-jobs`` set the policy for unknown xhpc
jobs for this run, and ``--job ID`` narrows cancel/adopt to the named jobs.
"""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from xhpc.cli.context import Ctx, emit_json, pass_ctx
from xhpc.orphans import (
    ActionKind,
    AppliedAction,
    OrphanAction,
    OrphanFixRequest,
    OrphanFixResult,
    OrphanPolicy,
    OrphanReport,
    plan_actions,
)

EXIT_CLEAN = 0
EXIT_ORPHANS = 1
_COLOURS = {"ok": "green", "warn": "yellow", "fail": "red"}


def _check_site(ctx: Ctx, as_json: bool, timeout_s: float, job_timeout_s: float) -> int:
    import asyncio

    from xhpc.sitecheck.run import run_site_checks
    from xhpc.sitecheck.verdicts import exit_code

    checks = asyncio.run(
        run_site_checks(ctx.config, timeout_s=timeout_s, job_timeout_s=job_timeout_s)
    )
    if as_json:
        emit_json([c.model_dump(mode="json") for c in checks])
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            colour = _COLOURS[c.verdict.value]
            verdict = f"[{colour}]{c.verdict.value:<4}[/{colour}]"
            ctx.console.print(f"{verdict}  {escape(c.name.ljust(width))}  {escape(c.detail)}")
    return exit_code(checks)


def _policy(cancel: bool, adopt: bool) -> OrphanPolicy | None:
    if cancel and adopt:
        raise click.UsageError("use --cancel-unknown-jobs or --adopt-jobs, not both")
    if cancel:
        return OrphanPolicy(job_without_replica="cancel")
    if adopt:
        return OrphanPolicy(job_without_replica="adopt")
    return None


def _verb(action: OrphanAction, applied: AppliedAction | None) -> str:
    if action.action is ActionKind.REPORT:
        return "report only"
    what = action.action.value
    if action.target is not None:
        what += f" -> {action.target.value}"
    if applied is None:
        return f"would {what}"
    if applied.applied:
        return f"[green]done: {what}[/green]"
    return f"[red]failed: {what}[/red] {escape(applied.error or '')}".rstrip()


def _tables(
    report: OrphanReport, actions: list[OrphanAction], applied: list[AppliedAction] | None
) -> list[Table]:
    done: list[AppliedAction | None] = list(applied) if applied else [None] * len(actions)
    verbs = [_verb(a, d) for a, d in zip(actions, done, strict=True)]
    n_gpu, n_job = len(report.gpu_processes), len(report.jobs)
    tables: list[Table] = []
    if report.gpu_processes:
        t = Table(title="GPU processes with no live Slurm job")
        for col in ("node", "gpu", "pid", "memory MiB", "job", "why", "fix"):
            t.add_column(col)
        for g, verb in zip(report.gpu_processes, verbs[:n_gpu], strict=True):
            mem = "-" if g.mem_used_mb is None else f"{g.mem_used_mb:.0f}"
            cells = [g.node, str(g.gpu), str(g.pid), mem, g.job_id or "-", g.reason]
            t.add_row(*map(escape, cells), verb)
        tables.append(t)
    if report.jobs:
        t = Table(title="xhpc jobs with no replica")
        for col in ("job", "state", "deployment", "replica", "row", "why", "fix"):
            t.add_column(col)
        for j, verb in zip(report.jobs, verbs[n_gpu : n_gpu + n_job], strict=True):
            row = j.row_state.value if j.row_state else "-"
            cells = [j.job_id, j.job_state, j.deployment, j.replica_id, row, j.reason]
            t.add_row(*map(escape, cells), verb)
        tables.append(t)
    if report.replicas:
        t = Table(title="replicas with no job")
        for col in ("replica", "deployment", "state", "job", "why", "fix"):
            t.add_column(col)
        for r, verb in zip(report.replicas, verbs[n_gpu + n_job :], strict=True):
            cells = [r.replica_id, r.deployment, r.state.value, r.job_id or "-", r.reason]
            t.add_row(*map(escape, cells), verb)
        tables.append(t)
    return tables


def _print(
    ctx: Ctx, report: OrphanReport, actions: list[OrphanAction], fix: OrphanFixResult | None
) -> None:
    applied = list(fix.actions) if fix is not None else None
    for table in _tables(report, actions, applied):
        ctx.console.print(table)
    if report.unprobed_nodes:
        nodes = escape(", ".join(report.unprobed_nodes))
        ctx.console.print(f"[dim]probe stale on {nodes}: GPU processes not checked there[/dim]")
    if report.count == 0:
        ctx.console.print("no orphans")


def _check_orphans(
    ctx: Ctx, fix: bool, policy: OrphanPolicy | None, jobs: tuple[str, ...], as_json: bool
) -> int:
    if not fix:
        report = ctx.broker.orphans()
        if as_json:
            emit_json({**report.model_dump(mode="json"), "count": report.count})
        else:
            planned = plan_actions(report, policy or ctx.config.orphans, job_ids=jobs or None)
            _print(ctx, report, planned, None)
        return EXIT_ORPHANS if report.count else EXIT_CLEAN
    body = OrphanFixRequest(policy=policy, job_ids=jobs or None)
    result = ctx.broker.fix_orphans(body)
    if as_json:
        emit_json({**result.model_dump(mode="json"), "unresolved": result.unresolved})
    else:
        _print(ctx, result.report, [a.action for a in result.actions], result)
    return EXIT_ORPHANS if result.unresolved else EXIT_CLEAN


@click.command()
@click.option("--orphans", "orphans", is_flag=True, help="Check for orphans (the default check).")
@click.option("--fix", is_flag=True, help="Apply the orphan policy through the broker.")
@click.option(
    "--cancel-unknown-jobs", is_flag=True, help="With --fix: scancel xhpc jobs with no replica."
)
@click.option(
    "--adopt-jobs", is_flag=True, help="With --fix: point live replica rows at their stray jobs."
)
@click.option(
    "--job", "jobs", multiple=True, metavar="JOB_ID", help="Cancel/adopt only these jobs."
)
@click.option(
    "--site", "site", is_flag=True, help="Check the Slurm site instead (no broker needed)."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="With --site: each check's limit in seconds.",
)
@click.option(
    "--job-timeout",
    "job_timeout_s",
    type=click.FloatRange(min=10),
    default=120.0,
    show_default=True,
    help="With --site: the compute node job's limit in seconds, queue wait included.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def doctor(
    ctx: Ctx,
    orphans: bool,
    site: bool,
    timeout_s: float,
    job_timeout_s: float,
    fix: bool,
    cancel_unknown_jobs: bool,
    adopt_jobs: bool,
    jobs: tuple[str, ...],
    as_json: bool,
) -> None:
    """Check the serving plane. Exit 0: clean; 1: orphans found (or left after --fix), or with
    --site a site check failed."""
    if site:
        if orphans or fix or cancel_unknown_jobs or adopt_jobs or jobs:
            raise click.UsageError("--site runs the site checks only: drop the orphan options")
        click.get_current_context().exit(_check_site(ctx, as_json, timeout_s, job_timeout_s))
    policy = _policy(cancel_unknown_jobs, adopt_jobs)
    del orphans  # the only check today, so it always runs
    code = _check_orphans(ctx, fix, policy, jobs, as_json)
    click.get_current_context().exit(code)
