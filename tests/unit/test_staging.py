"""Staging weights on a node's local disk: one copy per node and model however many replicas
stage it at once, checked by digest (a damaged copy is staged again), whole or absent, and
removal that never leaves the user's cache directory or follows a symlink."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from tests.unit.conftest import small_weights
from xhpc import weights
from xhpc.agent import staging
from xhpc.agent.staging import evict, main, model_lock, stage, user_dir
from xhpc.weights import WeightsError, tree_digest


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return small_weights(tmp_path / "shared" / "tiny")


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "scratch"


def test_a_staged_copy_has_the_shared_digest_and_is_owner_only(source: Path, local: Path) -> None:
    copy = stage(source, local, "tiny", user="u")
    assert copy.path == str(local / "u" / "tiny") and not copy.reused
    assert (copy.digest, copy.size_bytes) == tree_digest(source)
    assert (local / "u").stat().st_mode & 0o777 == 0o700
    assert [p.name for p in (local / "u").iterdir() if p.name.startswith(".tiny.tmp")] == []


def test_staging_reads_the_shared_copy_once(
    source: Path, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared filesystem is what makes cold starts slow: the shared copy is read by the copy
    alone (its digest is taken from the bytes as they are copied), not hashed as well."""
    hashed: list[Path] = []
    real = weights.file_sha256
    monkeypatch.setattr(weights, "file_sha256", lambda p: hashed.append(p) or real(p))
    copy = stage(source, local, "tiny")
    assert hashed and not [p for p in hashed if source in p.parents]
    assert copy.digest == tree_digest(source)[0]


def test_two_concurrent_stagers_make_one_copy_and_both_get_it(
    source: Path, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[Path] = []
    real_copytree = shutil.copytree
    started = threading.Event()

    def slow_copytree(src: Path, dst: Path, *args: object, **kwargs: object) -> object:
        if Path(src) == source:  # the top call (copytree calls itself for subdirectories)
            copies.append(Path(src))
            started.set()
            threading.Event().wait(0.3)  # the second stager arrives while this one copies
        return real_copytree(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(staging.shutil, "copytree", slow_copytree)
    results = []

    def run() -> None:
        results.append(stage(source, local, "tiny", user="u"))

    first = threading.Thread(target=run)
    first.start()
    started.wait(5)
    second = threading.Thread(target=run)
    second.start()
    first.join(10)
    second.join(10)
    assert len(copies) == 1
    assert sorted(r.reused for r in results) == [False, True]
    assert len({(r.path, r.digest) for r in results}) == 1


def test_a_damaged_copy_is_staged_again(source: Path, local: Path) -> None:
    first = stage(source, local, "tiny", user="u")
    (Path(first.path) / "model.safetensors").write_bytes(b"w" * 99_999)
    again = stage(source, local, "tiny", user="u")
    assert not again.reused and again.digest == first.digest
    assert stage(source, local, "tiny", user="u").reused


def test_a_copy_whose_digest_record_is_missing_is_staged_again(source: Path, local: Path) -> None:
    stage(source, local, "tiny", user="u")
    (local / "u" / ".tiny.digest").unlink()  # a stager killed between rename and record
    assert not stage(source, local, "tiny", user="u").reused


def test_a_source_with_a_symlink_is_not_staged(source: Path, local: Path) -> None:
    (source / "leak").symlink_to("/etc/passwd")
    with pytest.raises(WeightsError, match="symlink"):
        stage(source, local, "tiny", user="u")
    assert not (local / "u" / "tiny").exists()


def test_a_symlink_where_the_copy_should_be_is_replaced_not_followed(
    source: Path, local: Path, tmp_path: Path
) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("x")
    user_dir(local, "u")
    (local / "u" / "tiny").symlink_to(precious)
    (local / "u" / ".tiny.digest").write_text("sha256:" + "0" * 64)
    copy = stage(source, local, "tiny", user="u")
    assert not copy.reused and (precious / "keep").exists()
    (local / "u" / "other").symlink_to(precious)
    assert evict(local, ["other", "tiny"], user="u") == ["other", "tiny"]
    assert (precious / "keep").exists() and not (local / "u" / "tiny").exists()


def test_eviction_refuses_names_that_leave_the_cache_directory(local: Path) -> None:
    for bad in ("../x", "..", "a/b", ".hidden", ""):
        with pytest.raises(WeightsError, match="invalid model name"):
            evict(local, [bad], user="u")


def test_eviction_waits_for_a_stager_holding_the_lock(source: Path, local: Path) -> None:
    stage(source, local, "tiny", user="u")
    base = local / "u"
    done = threading.Event()
    with model_lock(base, "tiny"):
        t = threading.Thread(target=lambda: (evict(local, ["tiny"], user="u"), done.set()))
        t.start()
        assert not done.wait(0.3)
        assert (base / "tiny").exists()
    t.join(5)
    assert done.is_set() and not (base / "tiny").exists()


def test_the_evict_command_line(local: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert main(["evict", str(local), "absent"]) == 0
    assert "removed: nothing" in capsys.readouterr().out
    assert main(["evict", str(local), "../etc"]) == 1
    assert capsys.readouterr().err.startswith("error: invalid model name")
