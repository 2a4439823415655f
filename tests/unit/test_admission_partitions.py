"""`scontrol show partition` / `show config` parsing and Slurm time strings.

The real captures are tests/data/slurm/scontrol-show-{partition,config}.txt (see its README); the
lines marked HAND-WRITTEN below are not captures: the dev cluster has one partition with a finite
MaxTime, and its config is not changed for tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from xhpc.errors import SlurmParseError
from xhpc.models import PartitionInfo
from xhpc.settings import SlurmConfig
from xhpc.slurm import argv as A
from xhpc.slurm.client import CliSlurmClient
from xhpc.slurm.partitions import (
    access_problems,
    accounting_enabled,
    format_minutes,
    parse_partitions,
    parse_scontrol_config,
    parse_slurm_time,
    time_limit_problems,
)

Output = Callable[[str], str]

# HAND-WRITTEN (not captured): the forms the dev cluster does not show.
HAND_UNLIMITED = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO "
    "QoS=N/A DefaultTime=01:00:00 MaxTime=UNLIMITED Nodes=n[1-2] State=UP TotalNodes=2"
)
HAND_LONG = (
    "PartitionName=long AllowGroups=ALL AllowAccounts=physics,chem DenyQos=low AllowQos=ALL "
    "Default=NO DefaultTime=NONE Hidden=YES MaxTime=2-12:30:00 Nodes=(null) State=DOWN "
    "TRES=cpu=8,mem=8000M,node=1"
)
HAND_SPACES = "PartitionName=odd Alternate=two words here MaxTime=30 State=INACTIVE Nodes=n1"


# -- time strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("30", 30),  # minutes
        ("30:15", 31),  # minutes:seconds, seconds round up (as Slurm does)
        ("0:30", 1),
        ("01:00:00", 60),  # hours:minutes:seconds
        ("1:30:00", 90),
        ("00:00:00", 0),
        ("00:30:01", 31),
        ("2-12", 3600),  # days-hours
        ("2-12:30", 3630),  # days-hours:minutes
        ("2-12:30:00", 3630),  # days-hours:minutes:seconds
        ("1-00:00:00", 1440),
        ("UNLIMITED", None),
        ("INFINITE", None),
        ("unlimited", None),
    ],
)
def test_slurm_time_to_minutes(text: str, minutes: int | None) -> None:
    assert parse_slurm_time(text) == minutes


@pytest.mark.parametrize("text", ["", "soon", "1-", "-5", "1:2:3:4", "1-2-3", "1.5", "NONE"])
def test_bad_slurm_time(text: str) -> None:
    with pytest.raises(SlurmParseError, match="cannot read Slurm time"):
        parse_slurm_time(text)


@pytest.mark.parametrize(
    ("minutes", "text"),
    [
        (None, "UNLIMITED"),
        (0, "00:00:00"),
        (90, "01:30:00"),
        (1440, "1-00:00:00"),
        (3630, "2-12:30:00"),
    ],
)
def test_format_minutes_round_trips(minutes: int | None, text: str) -> None:
    assert format_minutes(minutes) == text
    assert parse_slurm_time(text) == minutes


# -- scontrol show partition ----------------------------------------------------------------------
def test_real_capture(slurm_output: Output) -> None:
    (gpu,) = parse_partitions(slurm_output("scontrol-show-partition.txt"))
    assert gpu == PartitionInfo(
        name="gpu",
        state="UP",
        default=True,
        nodes="n[1-3]",
        max_time_min=1440,
        default_time_min=None,
        allow_accounts=None,
        deny_accounts=(),
        allow_qos=None,
        deny_qos=(),
    )


def test_hand_written_forms() -> None:
    debug, long, odd = parse_partitions("\n".join((HAND_UNLIMITED, HAND_LONG, HAND_SPACES)))
    assert (debug.name, debug.max_time_min, debug.default_time_min) == ("debug", None, 60)
    assert (debug.default, debug.nodes, debug.allow_accounts) == (False, "n[1-2]", None)
    assert (long.max_time_min, long.default_time_min, long.state) == (3630, None, "DOWN")
    assert long.nodes is None
    assert long.allow_accounts == ("physics", "chem") and long.deny_accounts == ()
    assert long.allow_qos is None and long.deny_qos == ("low",)
    # A value with spaces does not eat the next key.
    assert (odd.max_time_min, odd.state, odd.nodes) == (30, "INACTIVE", "n1")


def test_no_partitions_and_bad_max_time() -> None:
    assert parse_partitions("No partitions in the system\n") == []
    assert parse_partitions("") == []
    with pytest.raises(SlurmParseError, match="partition p: MaxTime='soon'"):
        parse_partitions("PartitionName=p MaxTime=soon State=UP")


# -- scontrol show config -------------------------------------------------------------------------
def test_config_capture_has_no_accounting(slurm_output: Output) -> None:
    config = parse_scontrol_config(slurm_output("scontrol-show-config.txt"))
    assert config["AccountingStorageType"] == "accounting_storage/none"
    assert config["SLURM_VERSION"] == "22.05.8"
    assert config["UnkillableStepTimeout"] == "60 sec"
    assert "Configuration data as of 2026-11-29T13:26:21" not in config
    assert not accounting_enabled(config["AccountingStorageType"])


@pytest.mark.parametrize(
    ("storage", "enabled"),
    [
        (None, False),
        ("accounting_storage/none", False),
        ("(null)", False),
        ("accounting_storage/slurmdbd", True),
        ("accounting_storage/mysql", True),
    ],
)
def test_accounting_enabled(storage: str | None, enabled: bool) -> None:
    assert accounting_enabled(storage) is enabled


# -- limits ---------------------------------------------------------------------------------------
GPU = PartitionInfo(name="gpu", max_time_min=1440, allow_accounts=("physics",), deny_qos=("low",))


@pytest.mark.parametrize(
    ("time", "ok"),
    [
        ("1-00:00:00", True),
        ("24:00:00", True),
        ("1440", True),
        ("24:00:01", False),
        ("2-00:00:00", False),
        ("UNLIMITED", False),
    ],
)
def test_time_limit_against_max_time(time: str, ok: bool) -> None:
    found = time_limit_problems(time, "--time", GPU)
    assert found == (
        [] if ok else [f"--time {time} is longer than MaxTime 1-00:00:00 of partition 'gpu'"]
    )
    assert time_limit_problems(time, "--time", None) == []  # partition unknown: not checked
    unlimited = GPU.model_copy(update={"max_time_min": None})
    assert time_limit_problems(time, "--time", unlimited) == []


def test_access_lists() -> None:
    assert access_problems(GPU, "physics", "normal") == []
    assert access_problems(GPU, None, None) == []  # the user's defaults: only Slurm knows them
    assert access_problems(None, "x", "y") == []
    assert access_problems(GPU, "bio", "low") == [
        "account 'bio' may not use partition 'gpu' (AllowAccounts=physics)",
        "QOS 'low' is denied partition 'gpu' (DenyQos=low)",
    ]


# -- adapter --------------------------------------------------------------------------------------
def test_argv() -> None:
    assert A.scontrol_show_partitions() == ["scontrol", "--all", "--oneliner", "show", "partition"]
    assert A.scontrol_show_config(Path("/opt/slurm/bin")) == [
        "/opt/slurm/bin/scontrol",
        "show",
        "config",
    ]


def test_client_runs_scontrol(tmp_path: Path, slurm_output: Output) -> None:
    """The adapter through a stand-in `scontrol` that prints the real captures."""
    data = Path(__file__).resolve().parent.parent / "data" / "slurm"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f'case "$*" in *partition*) cat {data}/scontrol-show-partition.txt ;; '
        f"*) cat {data}/scontrol-show-config.txt ;; esac\n"
    )
    script.chmod(0o755)
    client = CliSlurmClient(SlurmConfig(bin_dir=bin_dir))
    parts = asyncio.run(client.partitions())
    assert [p.name for p in parts] == ["gpu"]
    assert asyncio.run(client.accounting_storage_type()) == "accounting_storage/none"
    assert (tmp_path / "calls").read_text().splitlines() == [
        "--all --oneliner show partition",
        "show config",
    ]
