"""What xhpc makes on a shared compute node is ours alone: GPU claims of in-allocation
servers, engines' scratch directories, and the checks behind them (``xhpc.agent.private``).

Another user of the node is a real uid: directories are made, then given away with ``chown``
(we are root)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.unit.conftest import OTHER_UID as OTHER
from tests.unit.conftest import give_to
from xhpc.agent import local
from xhpc.agent.agent import SPEC_FILE, TOKEN_FILE, Agent
from xhpc.agent.private import open_private, private_dir, scratch_dir, shared_base
from xhpc.errors import EngineError, UnsafePathError
from xhpc.models import AgentSpec, EngineKind

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: other users' files are chowned"),
]


def _job_env(tmpdir: Path) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "1,3", "TMPDIR": str(tmpdir)}


@pytest.fixture
def tmpdir(tmp_path: Path) -> Path:
    path = tmp_path / "job-tmp"
    path.mkdir()
    path.chmod(0o1777)  # like /tmp
    return path


# -- GPU claims of in-allocation servers ------------------------------------------------------
def test_a_claims_dir_another_user_made_first_is_refused_and_left_alone(tmpdir: Path) -> None:
    """(Refused on 6d94085 as well: kept so that it stays refused.)"""
    planted = tmpdir / f"xhpc-local-{os.geteuid()}-4242"
    planted.mkdir(mode=0o700)
    (planted / "other.json").write_text(json.dumps({"pid": 1, "gpus": [1, 3]}))
    give_to(planted, OTHER)
    with pytest.raises(UnsafePathError) as refused:
        local.claim_gpus(1, _job_env(tmpdir), "mine")
    assert refused.value.owner_uid == OTHER and refused.value.path == planted
    assert f"owner uid {OTHER}, mode drwx------" in str(refused.value)
    assert sorted(p.name for p in planted.iterdir()) == ["other.json"]


@pytest.mark.adversarial
def test_claims_under_a_tmpdir_another_user_owns_or_may_swap_are_refused(tmp_path: Path) -> None:
    """Failed on 6d94085 before the fix: the claims directory was made in a TMPDIR of another
    user (or one anyone may write, not sticky), whose owner can rename it away and put a
    directory of theirs, with claims of their choosing, in its place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    give_to(theirs, OTHER)
    with pytest.raises(UnsafePathError, match=f"belongs to another user, .*owner uid {OTHER}"):
        local.claim_gpus(1, _job_env(theirs), "mine")
    swappable = tmp_path / "swappable"
    swappable.mkdir()
    swappable.chmod(0o777)
    with pytest.raises(UnsafePathError, match="may be written by others and is not sticky"):
        local.claim_gpus(1, _job_env(swappable), "mine")
    assert list(theirs.iterdir()) == [] and list(swappable.iterdir()) == []


@pytest.mark.adversarial
def test_a_claim_file_of_another_user_is_no_claim(tmpdir: Path) -> None:
    """Failed on 6d94085 before the fix: a claim file of another uid in the claims directory
    (naming a live process and every GPU) was counted, so no server of ours got a GPU."""
    env = _job_env(tmpdir)
    claims = local.claims_dir(env)
    (claims / "squatter.json").write_text(json.dumps({"pid": os.getpid(), "gpus": [1, 3]}))
    os.chown(claims / "squatter.json", OTHER, OTHER)
    assert local.claim_gpus(2, env, "mine") == (1, 3)
    mine = claims / "mine.json"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600 and mine.stat().st_uid == os.geteuid()


def test_a_symlinked_claims_dir_or_lock_is_refused(tmpdir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmpdir / f"xhpc-local-{os.geteuid()}-4242"
    link.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        local.claim_gpus(1, _job_env(tmpdir), "mine")
    link.unlink()
    claims = local.claims_dir(_job_env(tmpdir))
    (claims / "lock").symlink_to(elsewhere / "lock")
    with pytest.raises(UnsafePathError, match="lock is not a regular file"):
        local.claim_gpus(1, _job_env(tmpdir), "mine")
    assert list(elsewhere.iterdir()) == []


# -- an engine's scratch directory ------------------------------------------------------------
def _agent(tmp_path: Path, tmpdir: Path) -> Agent:
    rdir = tmp_path / "replica"
    rdir.mkdir(mode=0o700)
    (tmp_path / "broker.json").write_text(json.dumps({"agent_url": "http://127.0.0.1:9"}))
    spec = AgentSpec(
        replica_id="m-0",
        deployment="m",
        engine=EngineKind.COMMAND,
        model_path="/models/m",
        served_model="m",
        broker_file=str(tmp_path / "broker.json"),
    )
    (rdir / SPEC_FILE).write_text(spec.model_dump_json())
    (rdir / TOKEN_FILE).write_text("t")
    return Agent(rdir, env={"SLURM_JOB_ID": "77", "TMPDIR": str(tmpdir)})


@pytest.mark.adversarial
def test_the_engines_scratch_dir_is_never_made_where_another_user_can_swap_it(
    tmp_path: Path,
) -> None:
    """Failed on 6d94085 before the fix: the scratch directory (the engine's working
    directory, first on its module path) was made in a TMPDIR of another user, who can rename
    it away and put a directory of modules in its place before the engine starts."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    give_to(theirs, OTHER)
    agent = _agent(tmp_path, theirs)
    with pytest.raises(EngineError, match=f"belongs to another user, .*owner uid {OTHER}"):
        agent._make_tmp_dir()
    assert agent.tmp_dir is None and list(theirs.iterdir()) == []


def test_the_scratch_dir_is_private_under_a_sticky_tmpdir(tmp_path: Path, tmpdir: Path) -> None:
    made = _agent(tmp_path, tmpdir)._make_tmp_dir()
    st = made.lstat()
    assert made.parent == tmpdir and made.name.startswith("xhpc-m-0-77-")
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


# -- the checks themselves --------------------------------------------------------------------
def test_a_private_dir_is_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        made = private_dir(tmp_path / "d")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_an_existing_dir_that_fails_is_refused_with_its_evidence(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    give_to(theirs, OTHER)
    with pytest.raises(UnsafePathError) as refused:
        private_dir(theirs, strict=False)
    err = refused.value
    assert (err.path, err.owner_uid, err.mode) == (theirs, OTHER, theirs.stat().st_mode)
    found = f"(owner uid {OTHER}, mode drwxr-xr-x)"
    assert str(err) == f"{theirs} belongs to another user {found}: refused"
    assert err.hint and "another user" in err.hint
    ours = tmp_path / "ours"
    ours.mkdir()
    ours.chmod(0o755)
    assert private_dir(ours, strict=False) == ours  # a copy of weights: others may read
    with pytest.raises(UnsafePathError, match="group or others may use it"):
        private_dir(ours)
    ours.chmod(0o775)
    with pytest.raises(UnsafePathError, match="group or others may write it"):
        private_dir(ours, strict=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafePathError, match="is not a directory"):
        private_dir(tmp_path / "file")


def test_a_fifo_or_a_foreign_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "lock")
    with pytest.raises(UnsafePathError, match="is not a regular file"):
        open_private(tmp_path / "lock", os.O_RDONLY)
    (tmp_path / "claim").write_text("{}")
    os.chown(tmp_path / "claim", OTHER, OTHER)
    with pytest.raises(UnsafePathError, match="belongs to another user"):
        open_private(tmp_path / "claim", os.O_RDONLY)
    os.close(open_private(tmp_path / "claim", os.O_RDONLY, owned=False))  # the site's store


def test_a_base_is_checked_up_to_the_root(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    (theirs / "deep").mkdir(parents=True)
    give_to(theirs, OTHER)
    os.chown(theirs / "deep", 0, 0)  # root's, inside another user's
    with pytest.raises(UnsafePathError, match=f"{theirs} belongs to another user"):
        shared_base(theirs / "deep")
    with pytest.raises(UnsafePathError, match="belongs to another user"):
        scratch_dir(theirs / "deep", "x-")
    assert shared_base(tmp_path / "new" / "base") == tmp_path / "new" / "base"  # made, ours
