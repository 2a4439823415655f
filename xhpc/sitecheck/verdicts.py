"""One verdict per site check, from what was found (pure; `xhpc doctor --site`).

Each function takes what Slurm printed (parsed), what an engine's Python said, or the report of
the short job on a compute node (``node``), and returns ``SiteCheck`` rows: ``ok``, ``warn``
(xhpc works, with a limit worth knowing) or ``fail`` (serving will not work until it is fixed;
``doctor --site`` then exits 1). A check that could not run says why in its own row.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from pydantic import ValidationError

from xhpc.models import Frozen, NodeInfo, PartitionInfo
from xhpc.sbatch_values import check_sbatch
from xhpc.slurm.partitions import format_minutes, time_limit_problems

OLDEST_TESTED = (22, 5)  # the Slurm release xhpc's captures and cluster tests come from
CLOCK_WARN_S = 5.0  # a node's clock further than this from the login node's: warn
REPORT_PREFIX = "xhpc-doctor-report "  # the node job's one line of JSON starts with this
# The package each engine's Python must import (the `command` engine has no package).
ENGINE_PACKAGES = {"vllm": "vllm", "transformers": "transformers"}
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


class Verdict(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


class SiteCheck(Frozen):
    """One line of `xhpc doctor --site`: the check's name, its verdict, what was found or what
    to do."""

    name: str
    verdict: Verdict
    detail: str


def ok(name: str, detail: str) -> SiteCheck:
    return SiteCheck(name=name, verdict=Verdict.OK, detail=detail)


def warn(name: str, detail: str) -> SiteCheck:
    return SiteCheck(name=name, verdict=Verdict.WARN, detail=detail)


def fail(name: str, detail: str) -> SiteCheck:
    return SiteCheck(name=name, verdict=Verdict.FAIL, detail=detail)


# ---- Slurm itself ---------------------------------------------------------------------------


def slurm_check(version: str, json_error: str | None) -> SiteCheck:
    """``sinfo --version``'s text and whether ``sinfo --json`` worked (None: it did)."""
    m = _VERSION.search(version)
    if m is None:
        return fail("slurm", f"cannot read Slurm's version from {version!r}")
    release = (int(m.group(1)), int(m.group(2)))
    shown = f"Slurm {m.group(0)}"
    if release < OLDEST_TESTED:
        oldest = "{}.{:02d}".format(*OLDEST_TESTED)
        return warn("slurm", f"{shown} is older than {oldest}, the oldest xhpc is tested with")
    if json_error is not None:
        return warn(
            "slurm",
            f"{shown}; `sinfo --json` does not work ({json_error}): xhpc reads the narrow "
            "`sinfo -O`/`squeue -O` listings, but a node reason or job name with a line break "
            "cannot be read then (build Slurm with its JSON plugins)",
        )
    return ok("slurm", f"{shown}; --json output works (the fallback for odd listings)")


def _hostlist(names: Sequence[str]) -> str:
    return ",".join(names) if len(names) <= 8 else ",".join(names[:8]) + f",… ({len(names)})"


def gres_check(nodes: Sequence[NodeInfo], partition: str | None) -> SiteCheck:
    """GPU GRES on the nodes of the partition xhpc submits to (None: every node)."""
    mine = [n for n in nodes if partition is None or partition in n.partitions]
    where = f"partition {partition}" if partition else "the cluster"
    if not mine:
        return fail("gres", f"no nodes in {where}")
    with_gpus = [n for n in mine if n.gpus_total > 0]
    if not with_gpus:
        return fail(
            "gres",
            f"no GPU GRES on any node of {where}: declare `GresTypes=gpu` and `Gres=gpu:N` "
            "on the nodes in slurm.conf, and the devices in gres.conf",
        )
    total = sum(n.gpus_total for n in with_gpus)
    kinds = sorted({f"gpu:{n.gpu_type}" if n.gpu_type else "gpu" for n in with_gpus})
    found = f"{total} GPUs ({', '.join(kinds)}) on {len(with_gpus)} of {len(mine)} nodes in {where}"
    without = [n.name for n in mine if n.gpus_total == 0]
    if without:
        return warn("gres", f"{found}; no GPU GRES on {_hostlist(without)}")
    return ok("gres", found)


def _partition_text(p: PartitionInfo, used: bool) -> str:
    marks = ("*" if p.default else "") + (" (xhpc's)" if used else "")
    default = format_minutes(p.default_time_min) if p.default_time_min is not None else "-"
    return (
        f"{p.name}{marks}: {p.state}, nodes {p.nodes or 'none'}, "
        f"MaxTime {format_minutes(p.max_time_min)}, DefaultTime {default}"
    )


def partition_check(
    partitions: Sequence[PartitionInfo], configured: str | None, default_time: str
) -> SiteCheck:
    """The partition xhpc submits to (``[slurm] partition``, else Slurm's default) exists, is
    UP, has nodes, and lets a job of ``[slurm] default_time`` run; the line lists them all."""
    if not partitions:
        return fail("partition", "Slurm has no partitions")
    listed = "; ".join(_partition_text(p, p.name == configured) for p in partitions)
    by_name = {p.name: p for p in partitions}
    if configured is None:
        default = next((p for p in partitions if p.default), None)
        if default is None:
            return fail(
                "partition",
                f"no [slurm] partition configured and Slurm has no default one ({listed})",
            )
        part = default
    elif configured not in by_name:
        return fail(
            "partition",
            f"[slurm] partition {configured!r} does not exist; Slurm has: {listed}",
        )
    else:
        part = by_name[configured]
    if part.state != "UP":
        return fail("partition", f"partition {part.name} is {part.state}: {listed}")
    if not part.nodes:
        return fail("partition", f"partition {part.name} has no nodes: {listed}")
    what = "[slurm] default_time"
    problems = time_limit_problems(default_time, what, part)
    if problems:
        return fail("partition", f"{problems[0]}: {listed}")
    return ok("partition", listed)


def accounting_check(
    storage_type: str | None, cluster: str | None, ping_error: str | None
) -> SiteCheck:
    """``AccountingStorageType`` and, with slurmdbd, whether one `sacct` answered (None: it
    did; not asked without accounting)."""
    kind = (storage_type or "").strip()
    if kind.lower() in {"", "(null)", "none", "accounting_storage/none"}:
        return warn(
            "accounting",
            f"accounting off (AccountingStorageType={kind or 'unset'}): `xhpc usage` shows "
            "GPU-hours as n/a and Slurm checks no account (set up slurmdbd to have both)",
        )
    if ping_error is not None:
        return fail(
            "accounting",
            f"{kind}, but `sacct` fails ({ping_error}): is slurmdbd running and reachable "
            "from this node?",
        )
    return ok("accounting", f"{kind} answers (sacct works; cluster {cluster or '?'})")


# ---- engines --------------------------------------------------------------------------------


class EngineSeen(Frozen):
    """What one engine's environment showed on the login node."""

    engine: str
    python: str  # as configured (or the default); "" for the `command` engine
    found: bool  # the interpreter (or the command) exists
    version: str | None = None  # the package's version, when it imported
    error: str | None = None  # the import's (or command's) failure


def engine_check(seen: EngineSeen, hint: str) -> SiteCheck:
    name = f"engine:{seen.engine}"
    if seen.engine not in ENGINE_PACKAGES:  # the `command` engine: its program exists
        if seen.error is not None:
            return fail(name, seen.error)
        return ok(name, f"command {seen.python} found")
    if not seen.found:
        return fail(name, f"its Python {seen.python} does not exist ({hint})")
    if seen.error is not None:
        package = ENGINE_PACKAGES[seen.engine]
        return fail(name, f"{seen.python} cannot import {package}: {seen.error} ({hint})")
    return ok(name, f"{seen.python} imports {ENGINE_PACKAGES[seen.engine]} {seen.version}")


def engine_probe_code(engine: str) -> str:
    """What an engine's Python runs to show that its package imports: prints its version."""
    package = ENGINE_PACKAGES[engine]
    return (
        "import importlib, importlib.metadata as m; "
        f"importlib.import_module({package!r}); print(m.version({package!r}))"
    )


# ---- the job on a compute node --------------------------------------------------------------


class PathSeen(Frozen):
    path: str
    exists: bool
    is_dir: bool = False
    readable: bool = False
    writable: bool = False
    error: str | None = None


class ConnectSeen(Frozen):
    target: str  # HOST:PORT
    ok: bool
    error: str | None = None
    # The login node's clock, from the answer's Date header (None: no answer or no header),
    # and the node's own at the middle of that exchange.
    server_time_s: float | None = None
    local_time_s: float | None = None


class NvmlSeen(Frozen):
    ok: bool
    gpus: int = 0
    driver: str | None = None
    error: str | None = None


class NodeReport(Frozen):
    """The one line of JSON the node job prints (after ``REPORT_PREFIX``)."""

    node: str
    time_s: float  # the node's clock when the job started
    connect: ConnectSeen | None = None
    paths: tuple[PathSeen, ...] = ()
    nvml: NvmlSeen


def parse_node_report(text: str) -> NodeReport | None:
    """The node job's output -> its report; None when no line holds a valid one."""
    for line in reversed(text.splitlines()):
        if line.startswith(REPORT_PREFIX):
            try:
                return NodeReport.model_validate_json(line[len(REPORT_PREFIX) :])
            except ValidationError:
                return None
    return None


def node_job_script(
    *,
    python: str,
    output: Path,
    partition: str | None,
    account: str | None,
    connect: str | None,
    paths: Sequence[str],
) -> str:
    """The node job's sbatch script: its ``#SBATCH`` values held to xhpc.sbatch_values'
    allow-list (ValueError otherwise: quoting does not protect those lines), its shell words
    quoted."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=xhpc-doctor",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --time=00:02:00",
        f"#SBATCH --output={check_sbatch('path', str(output), 'output path')}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={check_sbatch('name', partition, 'partition')}")
    if account:
        lines.append(f"#SBATCH --account={check_sbatch('name', account, 'account')}")
    argv = [python, "-I", "-m", "xhpc.sitecheck.node"]
    if connect:
        argv += ["--connect", connect]
    for path in paths:
        argv += ["--stat", path]
    lines.append("exec " + " ".join(q(a) for a in argv))
    return "\n".join(lines) + "\n"


class NodeWindow(Frozen):
    """The login node's clock just before the job was submitted and once its report was read:
    the node's clock, read in between, must fall inside (less exact than a Date header)."""

    submitted_s: float
    read_s: float


def _connect_check(report: NodeReport, label: str) -> SiteCheck:
    seen = report.connect
    if seen is None:
        return warn("agent-port", f"not checked: {label}")
    if seen.ok:
        return ok("agent-port", f"node {report.node} reaches {label} ({seen.target})")
    return fail(
        "agent-port",
        f"node {report.node} cannot reach {label} ({seen.target}: {seen.error}): jobs could not "
        "register; open the port to the compute nodes or set [broker] agent_bind / advertise_host",
    )


def _state_dir_check(report: NodeReport, state_dir: str) -> SiteCheck:
    seen = next((p for p in report.paths if p.path == state_dir), None)
    if seen is None:
        return warn("state-dir", f"not checked on node {report.node}")
    where = f"node {report.node}"
    if not seen.exists or not seen.is_dir:
        why = seen.error or ("not a directory" if seen.exists else "no such directory")
        return fail(
            "state-dir",
            f"{where} does not see state_dir {state_dir} ({why}): put it on a filesystem the "
            "compute nodes mount (jobs read their replica directories there)",
        )
    if not (seen.readable and seen.writable):
        return fail("state-dir", f"{where} sees state_dir {state_dir} but cannot read and write it")
    return ok("state-dir", f"{where} reads and writes {state_dir}")


def _nvml_check(report: NodeReport) -> SiteCheck:
    seen = report.nvml
    if not seen.ok:
        return warn(
            "nvml",
            f"no NVML on node {report.node} (fake GPUs?): {seen.error}; probes there need "
            "`--backend fake`, and GPU health is not watched",
        )
    return ok("nvml", f"node {report.node}: {seen.gpus} GPU(s), driver {seen.driver}")


def _clock_check(report: NodeReport, window: NodeWindow) -> SiteCheck:
    seen = report.connect
    if seen is not None and seen.server_time_s is not None and seen.local_time_s is not None:
        skew = seen.local_time_s - seen.server_time_s  # the Date header: whole seconds
        how = "against the login node's answer"
        slack = 1.0
    else:
        low, high = window.submitted_s, window.read_s
        skew = min(0.0, report.time_s - low) + max(0.0, report.time_s - high)
        how = "within the job's run, no answer to time it by"
        slack = 0.0
    text = f"node {report.node}'s clock is {skew:+.1f} s from the login node's ({how})"
    if abs(skew) > CLOCK_WARN_S + slack:
        return warn("clock", f"{text}: sync both with NTP (leases, logs and limits drift)")
    return ok("clock", text)


NODE_CHECKS = ("agent-port", "state-dir", "nvml", "clock")


def node_checks(
    report: NodeReport | None,
    *,
    why_none: str,
    target_label: str,
    state_dir: str,
    window: NodeWindow,
    state_dir_suspect: bool = False,
    none_verdict: Verdict = Verdict.FAIL,
) -> list[SiteCheck]:
    """The four checks the node job answers. With no report: each says why (``why_none``), as
    ``none_verdict`` (a job that only waited in the queue: ``warn``); a job that ran but whose
    output, written under the state directory, never came makes the state directory the failing
    one (``state_dir_suspect``) and leaves the others unchecked."""
    if report is None:
        if state_dir_suspect:
            rows = [
                fail(
                    "state-dir",
                    f"{why_none}: the job writes its output under state_dir {state_dir}; do "
                    "the compute nodes mount it?",
                )
            ]
            rows += [warn(n, "not checked: no report from the node job") for n in NODE_CHECKS[2:]]
            rows.insert(0, warn("agent-port", "not checked: no report from the node job"))
            return rows
        return [
            SiteCheck(name=n, verdict=none_verdict, detail=f"not checked: {why_none}")
            for n in NODE_CHECKS
        ]
    return [
        _connect_check(report, target_label),
        _state_dir_check(report, state_dir),
        _nvml_check(report),
        _clock_check(report, window),
    ]


def exit_code(checks: Sequence[SiteCheck]) -> int:
    return 1 if any(c.verdict is Verdict.FAIL for c in checks) else 0


# ---- the catalog's engine configurations ------------------------------------------------------


def engine_config_check(problems: dict[str, list[str]], schema_error: str | None) -> SiteCheck:
    """The site catalog's per-model engine configurations against the installed vLLM's own
    options (``problems``: each configured model's; ``schema_error``: why the schema could
    not be read, when it could not)."""
    name = "models:engine_config"
    bad = {model: found for model, found in problems.items() if found}
    if bad:
        shown = "; ".join(f"{m}: {', '.join(found)}" for m, found in sorted(bad.items()))
        return fail(name, shown)
    if schema_error is not None:
        return warn(
            name,
            f"cannot read vllm's options ({schema_error}): {len(problems)} model(s) checked by "
            "their types alone",
        )
    return ok(name, f"{len(problems)} model(s) fit the installed vllm's options")
