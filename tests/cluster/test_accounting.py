"""Slurm accounting on the real dev cluster (MariaDB + slurmdbd, made by scripts/dev-accounting):
`sacct` lists the jobs xhpc submits, and an API key's account must be one of its user's Slurm
associations (root is in lab1, the system user xhpc-member in lab2 only).

The dev cluster always has accounting: these tests fail on a cluster brought up before it
(`scripts/dev-cluster down && scripts/dev-cluster up` makes a new one).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Xhpc, slurm_env, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.security]

MEMBER = "xhpc-member"  # scripts/dev-accounting: a system user, associated with lab2 only


def _slurm(*argv: str) -> str:
    done = subprocess.run(
        argv, env=slurm_env(), check=True, capture_output=True, text=True, timeout=30
    )
    return done.stdout


def test_the_dev_cluster_keeps_accounting(dev_cluster: Path) -> None:
    config = _slurm("scontrol", "show", "config")
    assert "accounting_storage/slurmdbd" in config, "AccountingStorageType is not slurmdbd"
    assoc = _slurm("sacctmgr", "-nP", "show", "assoc", f"user={MEMBER}", "format=cluster,account")
    assert assoc.split() == ["xhpcdev|lab2"]
    root = _slurm("sacctmgr", "-nP", "show", "user", "where", "name=root", "format=defaultaccount")
    assert root.split() == ["lab1"]


def _sacct(job_id: str) -> list[list[str]]:
    out = _slurm("sacct", "-nP", "-X", "-j", job_id, "--format=JobID,JobName,Account,User,State")
    return [line.split("|") for line in out.splitlines() if line.strip()]


def test_sacct_lists_a_job_xhpc_submitted(xhpc_placeholder: Xhpc, unique_name: str) -> None:
    x, name = xhpc_placeholder, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--detach", "--json")
    (job,) = wait_for(x.my_jobs, 30, "the replica's job in squeue")

    def recorded() -> list[list[str]]:
        return [r for r in _sacct(job) if r[0] == job]

    def named() -> list[list[str]]:
        # slurmdbd may first record a pending job as "allocation", then under its own name.
        return [r for r in recorded() if r[1] == f"xhpc-{name}-0"]

    (row,) = wait_for(named, 60, f"job {job} in sacct under its own name")
    assert row[2:4] == ["lab1", "root"], row  # root's default account
    assert row[4] in {"PENDING", "RUNNING"}, row
    x.run("stop", name)

    def ended() -> bool:
        return all(r[4] not in {"PENDING", "RUNNING"} for r in recorded())

    wait_for(ended, 60, f"sacct to record the end of job {job}")


def test_a_keys_account_must_be_one_of_its_users_associations(xhpc: Xhpc) -> None:
    x = xhpc

    def create(*args: str) -> subprocess.CompletedProcess[str]:
        return x.run("keys", "create", *args, "--json", check=False)

    refused = create("--user", MEMBER, "--account", "lab1")
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    assert json.loads(refused.stdout)["error"]["message"] in line  # --json: the error as JSON
    assert f"user '{MEMBER}' may not use Slurm account 'lab1'" in line, line
    assert "their associations on this cluster: lab2" in line, line

    unknown = create("--user", "no-such-user-xhpc", "--account", "lab2")
    assert unknown.returncode != 0
    assert "no Unix user 'no-such-user-xhpc'" in unknown.stderr

    accepted = create("--user", MEMBER, "--account", "lab2")
    assert accepted.returncode == 0, accepted.stderr
    made: dict[str, Any] = json.loads(accepted.stdout)
    assert (made["view"]["user"], made["view"]["account"]) == (MEMBER, "lab2")
    assert made["warning"] is None and "warning" not in accepted.stderr
    listed = json.loads(x.run("keys", "list", "--json").stdout)
    assert [(k["user"], k["account"]) for k in listed] == [(MEMBER, "lab2")]


def test_usage_reports_the_gpu_hours_sacct_charged(
    xhpc_placeholder: Xhpc, unique_name: str
) -> None:
    """A served model's job ran (sacct shows it RUNNING for a few seconds) and was stopped:
    `xhpc usage` charges its GPU-hours to its owner, root, and the account Slurm charged,
    root's default lab1, on a line of their own (no key used the model)."""
    x, name = xhpc_placeholder, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--detach", "--json")
    (job,) = wait_for(x.my_jobs, 30, "the replica's job in squeue")

    def ran_3s() -> bool:
        out = _slurm("sacct", "-nP", "-X", "-j", job, "--format=JobID,State,ElapsedRaw")
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        return any(r[:2] == [job, "RUNNING"] and int(r[2]) >= 3 for r in rows)

    wait_for(ran_3s, 90, f"job {job} RUNNING in sacct for 3 s")
    x.run("stop", name)

    def charged() -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = json.loads(x.run("usage", "--json").stdout)
        return [u for u in lines if u["model"] == name and (u["gpu_hours"] or 0) > 0]

    (line,) = wait_for(charged, 60, f"GPU-hours of job {job} in `xhpc usage`")
    assert (line["user"], line["account"], line["key_id"]) == ("root", "lab1", "-"), line
    assert line["gpu_hours"] < 1, line  # seconds of one GPU
