"""Argv building for Slurm commands (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _bin(bin_dir: Path | None, name: str) -> str:
    return str(bin_dir / name) if bin_dir else name


def sinfo_json(bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "sinfo"), "--json"]


def squeue_json(bin_dir: Path | None = None) -> list[str]:
    # Slurm 22.05 ignores filter options (--jobs, --me, ...) when --json is given.
    return [_bin(bin_dir, "squeue"), "--json"]


def sinfo_nodes(fields: str, bin_dir: Path | None = None) -> list[str]:
    # --all: hidden partitions too; --Node: a line per node and partition; partitions in the
    # configured order (a node's list as Slurm keeps it).
    return [_bin(bin_dir, "sinfo"), "--all", "--noheader", "--Node", "--sort=#P", "-O", fields]


def squeue_jobs(fields: str, bin_dir: Path | None = None) -> list[str]:
    # -t all: ended jobs still in slurmctld's memory too, as --json lists them.
    return [_bin(bin_dir, "squeue"), "--noheader", "--states=all", "-O", fields]


def scontrol_show_jobs(job_id: str | None = None, bin_dir: Path | None = None) -> list[str]:
    # --details: the GPU indexes of each node; --oneliner: one line per job. All jobs, or one.
    argv = [_bin(bin_dir, "scontrol"), "--details", "--oneliner", "show", "job"]
    return [*argv, job_id] if job_id else argv


def scontrol_requeue(job_ids: Sequence[str], bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "scontrol"), "requeue", ",".join(job_ids)]


def sbatch_parsable(script: Path, bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "sbatch"), "--parsable", str(script)]


def sbatch_test_only(
    options: Sequence[str], partition: str | None, node: str, bin_dir: Path | None = None
) -> list[str]:
    """When would a job with ``options`` (``--gres=...``, ``--time=...``: the replica's shape)
    start on ``node`` in ``partition``? Submits nothing; ``--wrap``: no script file needed."""
    argv = [_bin(bin_dir, "sbatch"), "--test-only", *options, f"--nodelist={node}"]
    if partition:
        argv.append(f"--partition={partition}")
    return [*argv, "--wrap=true"]


def scancel(
    job_ids: Sequence[str],
    bin_dir: Path | None = None,
    signal: str | None = None,
    batch_only: bool = False,
) -> list[str]:
    argv = [_bin(bin_dir, "scancel")]
    if signal:
        argv.append(f"--signal={signal}")
    if batch_only:
        argv.append("--batch")
    return [*argv, *job_ids]


def scontrol_show_partitions(bin_dir: Path | None = None) -> list[str]:
    # --all: hidden partitions too; --oneliner: one `Key=Value ...` line per partition.
    return [_bin(bin_dir, "scontrol"), "--all", "--oneliner", "show", "partition"]


def scontrol_show_topology(bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "scontrol"), "show", "topology"]


def scontrol_show_config(bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "scontrol"), "show", "config"]


def sacctmgr_user_associations(user: str, bin_dir: Path | None = None) -> list[str]:
    # Every cluster of the accounting database: the caller keeps its own ClusterName's.
    return [
        _bin(bin_dir, "sacctmgr"),
        "--noheader",
        "--parsable2",
        "show",
        "associations",
        "where",
        f"user={user}",
        "format=cluster,account",
    ]


def sacct_usage(
    job_ids: Sequence[str], user: str, fields: Sequence[str], bin_dir: Path | None = None
) -> list[str]:
    # One record per job allocation (hetjob components: LEADER+OFFSET), every run of a requeued
    # job; only this user's jobs, so another user's job with a reused id is never read.
    return [
        _bin(bin_dir, "sacct"),
        "--allocations",
        "--duplicates",
        "--noheader",
        "--parsable2",
        f"--user={user}",
        f"--jobs={','.join(job_ids)}",
        f"--format={','.join(fields)}",
    ]


def sinfo_version(bin_dir: Path | None = None) -> list[str]:
    return [_bin(bin_dir, "sinfo"), "--version"]


def sacct_ping(bin_dir: Path | None = None) -> list[str]:
    # The smallest question slurmdbd must answer: this user's allocations since a minute ago.
    return [
        _bin(bin_dir, "sacct"),
        "--allocations",
        "--noheader",
        "--parsable2",
        "--starttime=now-60",
        "--format=JobID",
    ]
