"""Owners on a shared (lab) broker: the broker tells Unix users apart by the peer credentials
of its socket; a user cannot stop or scale another user's model, its owner can."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_pilot import ECHO_ENGINE
from tests.conftest import Xhpc, _start_xhpc, _teardown_xhpc, as_uid, xhpc_as

pytestmark = [pytest.mark.cluster, pytest.mark.security]

OTHER_UID = 4242  # a uid with no account: the broker names it "uid4242"


@pytest.fixture
def lab_broker(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    x = _start_xhpc(tiny_model, ECHO_ENGINE + "\n[broker]\nshared_socket = true\n")
    yield x
    _teardown_xhpc(x)


def _as_other(x: Xhpc, *args: str) -> subprocess.CompletedProcess[str]:
    argv, extra = xhpc_as(OTHER_UID)
    env = {**x.env, "HOME": "/tmp", **extra}
    return subprocess.run(
        [*as_uid(OTHER_UID), *argv, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_only_the_owner_stops_or_scales(lab_broker: Xhpc, unique_name: str) -> None:
    x, name = lab_broker, unique_name
    x.run("serve", "tiny-llama", "--name", name, "--engine", "command", "--timeout", "90")
    # Another Unix user reaches the lab broker and sees the model...
    seen = _as_other(x, "ps")
    assert seen.returncode == 0, seen.stderr
    assert name in seen.stdout
    # ...but may not stop, scale or read the logs of it: one line, non-zero, nothing changed.
    for args in (
        ("stop", name),
        ("stop", f"{name}-0"),
        ("scale", name, "2"),
        ("logs", f"{name}-0"),
    ):
        refused = _as_other(x, *args)
        assert refused.returncode != 0
        assert f"belongs to root; you are uid{OTHER_UID}" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    rows = json.loads(x.run("ps", "--json").stdout)
    assert [r["state"] for r in rows if r["deployment"] == name] == ["READY"]
    assert len(x.my_jobs()) == 1
    # The state directory stays closed: the DB and the replica's files are owner-only.
    assert (x.state_dir / "xhpc.db").stat().st_mode & 0o077 == 0
    x.run("stop", name)
