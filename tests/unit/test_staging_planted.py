"""The weights cache on a node shared with other users: what another user made first under
``[cache] local_dir`` is refused (never served, never removed), and a node-local copy is used
only when its content has the digest the broker's ledger holds for the shared copy.

Other users are real uids: directories are made and then given away with ``chown`` (we are
root), and one test runs the stager itself as an unprivileged user (setpriv)."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SYSTEM_PYTHON, as_uid, needs_other_users, package_copy_env
from tests.unit.conftest import OTHER_UID as OTHER
from tests.unit.conftest import give_to, small_weights
from xhpc.agent.agent import SPEC_FILE, TOKEN_FILE, Agent
from xhpc.agent.staging import evict, model_lock, stage, user_dir
from xhpc.errors import UnsafePathError
from xhpc.models import AgentSpec, EngineKind
from xhpc.weights import WeightsError, tree_digest

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: other users' files are chowned"),
]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return small_weights(tmp_path / "shared" / "tiny")


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "scratch"


def _planted_copy(directory: Path) -> str:
    """Weights of the other user's choosing and a digest record that matches them."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"planted": true}')
    (directory / "model.safetensors").write_bytes(b"evil" * 1000)
    digest = tree_digest(directory)[0]
    (directory.parent / f".{directory.name}.digest").write_text(digest + "\n")
    return digest


@pytest.mark.adversarial
def test_a_user_dir_another_user_made_first_is_refused_and_its_weights_never_served(
    source: Path, local: Path
) -> None:
    """Failed on 6d94085 before the fix: the stager took ``<local_dir>/<user>`` as it found it
    (another uid's, mode 0777), reused the planted copy because it matched the planted digest
    file beside it, and returned its path for the engine to load."""
    mine = local / "u"
    mine.mkdir(parents=True, mode=0o777)
    mine.chmod(0o777)
    _planted_copy(mine / "tiny")
    give_to(mine, OTHER)
    with pytest.raises(UnsafePathError) as refused:
        stage(source, local, "tiny", user="u")
    err = refused.value
    assert (err.path, err.owner_uid) == (mine, OTHER) and err.mode is not None
    assert f"{mine} belongs to another user (owner uid {OTHER}, mode drwxrwxrwx)" in str(err)
    assert (mine / "tiny" / "model.safetensors").read_bytes() == b"evil" * 1000  # left alone


@pytest.mark.adversarial
def test_our_user_dir_open_to_others_is_refused(source: Path, local: Path) -> None:
    """Failed on 6d94085 before the fix: a user dir of ours that others may write (0777) was
    used, with a model directory another user put in it and its matching digest file."""
    mine = local / "u"
    mine.mkdir(parents=True)
    mine.chmod(0o777)
    _planted_copy(mine / "tiny")
    give_to(mine / "tiny", OTHER)
    with pytest.raises(UnsafePathError, match="group or others may use it"):
        stage(source, local, "tiny", user="u")
    mine.chmod(0o750)  # group may read: still not private
    with pytest.raises(UnsafePathError, match=r"mode drwxr-x---"):
        stage(source, local, "tiny", user="u")


@pytest.mark.adversarial
def test_another_users_model_dir_in_our_dir_is_refused_and_not_removed(
    source: Path, local: Path
) -> None:
    """Failed on 6d94085 before the fix: a model directory of another uid inside our cache
    directory was served when its digest record matched, and removed (shutil.rmtree) by
    ``evict`` or by a stager when it did not."""
    base = user_dir(local, "u")
    _planted_copy(base / "tiny")
    give_to(base / "tiny", OTHER)
    with pytest.raises(UnsafePathError, match=f"tiny belongs to another user .owner uid {OTHER}"):
        stage(source, local, "tiny", user="u")
    with pytest.raises(UnsafePathError, match="belongs to another user"):
        evict(local, ["tiny"], user="u")
    assert (base / "tiny" / "model.safetensors").read_bytes() == b"evil" * 1000


@pytest.mark.adversarial
def test_a_cache_base_another_user_owns_or_swaps_is_refused(source: Path, tmp_path: Path) -> None:
    """Failed on 6d94085 before the fix: ``local_dir`` made first by another user (or a
    symlink of theirs to such a directory) was used: the copy went into a directory whose
    owner can rename it away and put theirs in its place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    give_to(theirs, OTHER)
    with pytest.raises(UnsafePathError, match=f"belongs to another user, .*owner uid {OTHER}"):
        stage(source, theirs, "tiny", user="u")
    link = tmp_path / "link"
    link.symlink_to(theirs)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(UnsafePathError, match="is a symlink of another user"):
        stage(source, link, "tiny", user="u")
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)  # root's, but anyone may rename entries: not sticky
    with pytest.raises(UnsafePathError, match="may be written by others and is not sticky"):
        stage(source, open_to_all, "tiny", user="u")
    assert list(theirs.iterdir()) == [] and list(open_to_all.iterdir()) == []
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: fine, what we make in it stays ours
    assert stage(source, sticky, "tiny", user="u").digest == tree_digest(source)[0]


def test_a_symlinked_user_dir_is_refused(source: Path, local: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    local.mkdir()
    (local / "u").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match=r"scratch/u is a symlink"):
        stage(source, local, "tiny", user="u")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.adversarial
def test_a_lock_file_of_another_user_is_refused(local: Path) -> None:
    """Failed on 6d94085 before the fix: ``.<model>.lock`` was opened and locked whoever owned
    it (O_NOFOLLOW only): a lock another user holds stalls every stager of the model."""
    base = user_dir(local, "u")
    (base / ".tiny.lock").write_text("")
    os.chown(base / ".tiny.lock", OTHER, OTHER)
    refused = pytest.raises(UnsafePathError, match=r"\.tiny\.lock belongs to another user")
    with refused, model_lock(base, "tiny"):
        pass


@pytest.mark.adversarial
def test_an_altered_copy_with_a_matching_record_is_caught_by_the_ledger_digest(
    source: Path, local: Path
) -> None:
    """Failed on 6d94085 before the fix: a local copy is checked against the digest record in
    the same directory, so weights altered together with their record were reused (stage took
    no digest from the ledger)."""
    ledger = tree_digest(source)[0]
    first = stage(source, local, "tiny", user="u", expected=ledger)
    target = Path(first.path)
    (target / "model.safetensors").write_bytes(b"evil" * 1000)
    (local / "u" / ".tiny.digest").write_text(tree_digest(target)[0] + "\n")
    again = stage(source, local, "tiny", user="u", expected=ledger)
    assert not again.reused and again.digest == ledger
    assert tree_digest(target)[0] == ledger  # the shared weights, not the altered ones
    assert stage(source, local, "tiny", user="u", expected=ledger).reused


def test_a_shared_copy_that_differs_from_the_ledger_is_not_staged(
    source: Path, local: Path
) -> None:
    with pytest.raises(WeightsError, match="does not match the ledger's digest"):
        stage(source, local, "tiny", user="u", expected="sha256:" + "0" * 64)
    assert sorted(p.name for p in (local / "u").iterdir()) == [".tiny.lock"]


def test_first_use_reports_the_shared_copys_digest_as_read(source: Path, local: Path) -> None:
    """No ledger digest yet: the digest comes from the bytes read from the shared copy (and
    the copy on disk agrees); the copy is private and writable by nobody else."""
    (source / "sub").chmod(0o777)  # the shared store's modes are not carried to others' writes
    copy = stage(source, local, "tiny", user="u")
    assert (copy.digest, copy.size_bytes) == tree_digest(source)
    assert copy.source == str(source) and not copy.reused
    assert (local / "u").stat().st_mode & 0o777 == 0o700
    for root, dirs, files in os.walk(copy.path):
        for name in [root, *(os.path.join(root, n) for n in [*dirs, *files])]:
            assert os.lstat(name).st_mode & 0o022 == 0 and os.lstat(name).st_uid == os.geteuid()


def test_the_user_dir_is_0700_whatever_the_umask(source: Path, local: Path) -> None:
    old = os.umask(0o277)  # would make mkdir(0o700) a 0o500 directory
    try:
        stage(source, local, "tiny", user="u")
    finally:
        os.umask(old)
    assert (local / "u").stat().st_mode & 0o777 == 0o700


# -- the agent: what its engine is pointed at -------------------------------------------------
def _agent(tmp_path: Path, source: Path, local: Path, digest: str | None) -> Agent:
    rdir = tmp_path / "replica"
    rdir.mkdir(mode=0o700, exist_ok=True)
    (tmp_path / "broker.json").write_text(json.dumps({"agent_url": "http://127.0.0.1:9"}))
    spec = AgentSpec(
        replica_id="tiny-0",
        deployment="tiny",
        engine=EngineKind.COMMAND,
        model_path=str(source),
        served_model="tiny",
        broker_file=str(tmp_path / "broker.json"),
        stage_dir=str(local),
        weights_digest=digest,
    )
    (rdir / SPEC_FILE).write_text(spec.model_dump_json())
    (rdir / TOKEN_FILE).write_text("t")
    return Agent(rdir, env={"SLURM_JOB_ID": "5"})


async def test_the_agent_loads_the_shared_copy_when_the_cache_dir_was_planted(
    tmp_path: Path, source: Path, local: Path
) -> None:
    """A planted cache directory costs the replica its fast start, never its weights."""
    mine = local / getpass.getuser()  # where the agent stages

    mine.mkdir(parents=True)
    _planted_copy(mine / "tiny")
    give_to(mine, OTHER)
    agent = _agent(tmp_path, source, local, tree_digest(source)[0])
    assert await agent.stage_weights() is None
    assert agent.spec.model_path == str(source)  # the engine loads the shared copy


async def test_the_agent_checks_a_found_copy_against_the_spec_digest(
    tmp_path: Path, source: Path, local: Path
) -> None:
    ledger = tree_digest(source)[0]
    first = await _agent(tmp_path, source, local, ledger).stage_weights()
    assert first is not None and not first.reused
    (Path(first.path) / "config.json").write_text('{"planted": true}')
    (local / getpass.getuser() / ".tiny.digest").write_text(tree_digest(Path(first.path))[0])
    agent = _agent(tmp_path, source, local, ledger)
    again = await agent.stage_weights()
    assert again is not None and not again.reused and again.digest == ledger
    assert agent.spec.model_path == first.path
    assert (Path(first.path) / "config.json").read_text() == "{}"


# -- as an unprivileged user ------------------------------------------------------------------
VICTIM, ATTACKER = 65534, 65533

STAGE_AS_VICTIM = """
import json, sys
from pathlib import Path
from xhpc.agent.staging import stage
from xhpc.errors import XhpcError
try:
    copy = stage(Path(sys.argv[1]), Path(sys.argv[2]), "tiny", user="victim")
    print(json.dumps({"path": copy.path, "reused": copy.reused}))
except XhpcError as err:
    print(json.dumps({"error": str(err)}))
"""


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Path]:
    """A directory every user may reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="xt-planted-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@needs_other_users
@pytest.mark.adversarial
def test_a_user_dir_planted_by_one_user_is_refused_to_another(world: Path) -> None:
    """Failed on 6d94085 before the fix: run as an ordinary user, the stager found
    ``<local_dir>/victim`` made (0777) by another user, with weights and a matching digest
    file, and returned the planted copy as reused."""
    source = small_weights(world / "shared" / "tiny")
    subprocess.run(["chmod", "-R", "a+rX", str(world / "shared")], check=True)
    local = world / "local"
    local.mkdir()
    local.chmod(0o1777)
    planted = local / "victim"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    _planted_copy(planted / "tiny")
    subprocess.run(["chmod", "-R", "a+rwX", str(planted)], check=True)
    give_to(planted, ATTACKER)
    env = package_copy_env()
    out = subprocess.run(
        [*as_uid(VICTIM), SYSTEM_PYTHON, "-c", STAGE_AS_VICTIM, str(source), str(local)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **env},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "error" in result, f"the victim was handed {result}"
    assert f"belongs to another user (owner uid {ATTACKER}" in result["error"]
    assert (planted / "tiny" / "model.safetensors").read_bytes() == b"evil" * 1000
