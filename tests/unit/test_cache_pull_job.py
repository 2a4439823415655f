"""A pull job's side of `xhpc cache pull`: DIR copied into the shared store under a temporary name,
checked by digest and renamed into place; a damaged source, a different copy already there (no
--replace) or a symlink anywhere leaves the store as it was, with nothing half-copied."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.conftest import small_weights
from xhpc.agent import pull as pull_mod
from xhpc.agent.pull import pull
from xhpc.agent.staging import main
from xhpc.weights import PullResult, WeightsError, tree_digest


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return small_weights(tmp_path / "incoming" / "tiny")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


def leftovers(store: Path) -> list[str]:
    """Anything in the store but copies and lock files: a temporary directory left behind."""
    return sorted(p.name for p in store.iterdir() if ".pull-" in p.name)


def test_a_pull_copies_the_directory_whole_with_the_sources_digest(
    source: Path, store: Path
) -> None:
    result = pull(source, store, "tiny")
    assert result.path == str(store / "tiny") and not (result.unchanged or result.replaced)
    assert (result.digest, result.size_bytes) == tree_digest(source)
    assert tree_digest(store / "tiny") == tree_digest(source)
    assert leftovers(store) == []
    # the same content again: nothing copied, the copy left as it is
    inode = (store / "tiny").stat().st_ino
    again = pull(source, store, "tiny")
    assert again.unchanged and (store / "tiny").stat().st_ino == inode


def test_a_different_copy_is_kept_unless_replace(source: Path, store: Path) -> None:
    old = store / "tiny"
    old.mkdir()
    (old / "config.json").write_text('{"old": true}')
    before = tree_digest(old)
    with pytest.raises(WeightsError, match=r"holds other weights \(sha256:.*pass --replace"):
        pull(source, store, "tiny")
    assert tree_digest(old) == before and leftovers(store) == []
    result = pull(source, store, "tiny", replace=True)
    assert result.replaced and tree_digest(old) == tree_digest(source)
    assert leftovers(store) == []


def test_a_source_changed_while_copied_replaces_nothing(
    source: Path, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = store / "tiny"
    old.mkdir()
    (old / "config.json").write_text('{"old": true}')
    before = tree_digest(old)
    real = pull_mod.shutil.copytree

    def damaging_copytree(src: Path, dst: Path, *args: Any, **kwargs: Any) -> object:
        out = real(src, dst, *args, **kwargs)
        (Path(dst) / "model.safetensors").write_bytes(b"x" * 10)  # cut short on the way
        return out

    monkeypatch.setattr(pull_mod.shutil, "copytree", damaging_copytree)
    with pytest.raises(WeightsError, match="does not match its digest"):
        pull(source, store, "tiny", replace=True)
    assert tree_digest(old) == before and leftovers(store) == []


def test_symlinks_are_refused_in_the_source_and_at_the_destination(
    source: Path, store: Path, tmp_path: Path
) -> None:
    (tmp_path / "secret").write_text("not weights")
    (source / "sub" / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(WeightsError, match="holds a symlink: sub/link"):
        pull(source, store, "tiny")
    assert sorted(p.name for p in store.iterdir()) == []  # refused before the lock or a copy
    (source / "sub" / "link").unlink()
    (store / "tiny").symlink_to(tmp_path)  # the destination points elsewhere
    with pytest.raises(WeightsError, match="holds something that is no plain copy"):
        pull(source, store, "tiny")
    assert (store / "tiny").is_symlink()
    pull(source, store, "tiny", replace=True)  # the link itself goes, not what it points to
    assert not (store / "tiny").is_symlink() and (tmp_path / "secret").exists()


def test_a_source_without_config_json_or_a_bad_name_is_refused(source: Path, store: Path) -> None:
    with pytest.raises(WeightsError, match="invalid model name"):
        pull(source, store, "../etc")
    (source / "config.json").unlink()
    with pytest.raises(WeightsError, match=r"has no config\.json"):
        pull(source, store, "tiny")
    assert list(store.iterdir()) == []


def test_the_pull_command_line_writes_its_result_even_on_failure(
    source: Path, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_file = tmp_path / "state" / "pull-1.result.json"
    result_file.parent.mkdir()
    assert main(["pull", str(source), str(store), "tiny", str(result_file)]) == 0
    done = PullResult.model_validate_json(result_file.read_text())
    assert done.digest == tree_digest(source)[0] and done.error is None
    assert result_file.stat().st_mode & 0o777 == 0o600
    assert "copied: " in capsys.readouterr().out
    (store / "tiny" / "config.json").write_text('{"changed": 1}')
    assert main(["pull", str(source), str(store), "tiny", str(result_file)]) == 1
    failed = json.loads(result_file.read_text())
    assert "pass --replace" in failed["error"] and failed["digest"] is None
    assert capsys.readouterr().err.startswith("error: ")
    argv = ["pull", str(source), str(store), "tiny", str(result_file), "--replace"]
    assert main(argv) == 0
    assert PullResult.model_validate_json(result_file.read_text()).replaced
    assert main(["pull", str(source)]) == 2
    assert not any(
        p.name.startswith(".") and p.name.endswith(".tmp") for p in os.scandir(result_file.parent)
    )
