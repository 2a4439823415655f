"""The weights cache's pure logic: the content digest of a model directory, sizes, and which
node-local copies a prune removes (least recent use first, never one a live replica uses)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from xhpc.errors import ValidationError
from xhpc.weights import (
    CacheCopy,
    FileEntry,
    WeightsError,
    digest_of,
    parse_size,
    prune_plan,
    refuse_in_use,
    tree_digest,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GIB = 1024**3


def _model(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "model.safetensors").write_bytes(b"\x00" * 1000)
    (root / "sub" / "tokenizer.json").write_text("{}")
    return root


def test_the_digest_names_the_content_not_the_place_or_the_times(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b")
    os.utime(b / "config.json", (0, 0))
    digest, size = tree_digest(a)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert size == len('{"a": 1}') + 1000 + 2
    assert tree_digest(b) == (digest, size)


def test_one_changed_byte_renamed_or_missing_file_changes_the_digest(tmp_path: Path) -> None:
    base = tree_digest(_model(tmp_path / "a"))[0]
    changed = _model(tmp_path / "b")
    (changed / "model.safetensors").write_bytes(b"\x00" * 999 + b"\x01")
    renamed = _model(tmp_path / "c")
    (renamed / "sub" / "tokenizer.json").rename(renamed / "tokenizer.json")
    cut = _model(tmp_path / "d")
    (cut / "config.json").unlink()
    digests = {base, *(tree_digest(p)[0] for p in (changed, renamed, cut))}
    assert len(digests) == 4


def test_the_digest_of_entries_does_not_depend_on_their_order() -> None:
    entries = [FileEntry(path=p, size=1, sha256="0" * 64) for p in ("b", "a", "c/d")]
    assert digest_of(entries) == digest_of(reversed(entries)) == digest_of(sorted(entries, key=str))
    assert digest_of(entries) != digest_of(entries[:2])


def test_a_symlink_or_a_missing_directory_has_no_digest(tmp_path: Path) -> None:
    root = _model(tmp_path / "m")
    (root / "leak").symlink_to("/etc/passwd")
    with pytest.raises(WeightsError, match="symlink: leak"):
        tree_digest(root)
    linked = tmp_path / "linked"
    linked.symlink_to(_model(tmp_path / "n"))
    with pytest.raises(WeightsError, match="not a directory"):
        tree_digest(linked)
    with pytest.raises(WeightsError, match="cannot be read"):
        tree_digest(tmp_path / "absent")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("500M", 500 * 1024**2),
        ("20G", 20 * GIB),
        ("1.5T", int(1.5 * 1024**4)),
        ("2GiB", 2 * GIB),
        ("123", 123),
        ("10 gb", 10 * GIB),
    ],
)
def test_sizes_are_read_as_people_write_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1G", "ten", "5X", "1G; rm"])
def test_a_bad_size_is_refused(text: str) -> None:
    with pytest.raises(ValidationError, match="invalid size"):
        parse_size(text)


def _copy(model: str, node: str, gib: int, used_h: int | None, *live: str) -> CacheCopy:
    used = None if used_h is None else T0 + timedelta(hours=used_h)
    return CacheCopy(
        model=model,
        node=node,
        path=f"/scratch/{model}",
        size_bytes=gib * GIB,
        digest="sha256:" + "0" * 64,
        last_used_at=used,
        users=live,
        in_use_by=live,
    )


def test_prune_removes_least_recently_used_first_until_under_budget() -> None:
    copies = [
        _copy("a", "n1", 10, 5),
        _copy("b", "n1", 10, 1),
        _copy("c", "n1", 10, 9),
        _copy("d", "n1", 10, None),  # never used: goes first
        _copy("e", "n2", 10, 0),
    ]
    removed, kept = prune_plan(copies, 20 * GIB)
    assert [c.model for c in removed] == ["d", "b"]
    assert kept == []


def test_prune_never_removes_what_a_live_replica_uses_and_says_why_it_stays_over() -> None:
    copies = [_copy("a", "n1", 10, 0, "a-0"), _copy("b", "n1", 10, 5), _copy("c", "n1", 10, 9)]
    removed, kept = prune_plan(copies, 0)
    assert [c.model for c in removed] == ["b", "c"]
    assert kept == ["n1: 10.0 GiB left over the budget of 0 B: in use (a)"]


def test_prune_of_one_node_leaves_the_others() -> None:
    copies = [_copy("a", "n1", 10, 0), _copy("a", "n2", 10, 0)]
    removed, _ = prune_plan(copies, 0, node="n2")
    assert [(c.model, c.node) for c in removed] == [("a", "n2")]


def test_a_shared_copy_is_never_pruned() -> None:
    shared = _copy("a", "n1", 10, 0).model_copy(update={"node": None})
    assert prune_plan([shared], 0) == ([], [])


def test_rm_refuses_a_copy_in_use_in_one_line() -> None:
    with pytest.raises(ValidationError) as err:
        refuse_in_use([_copy("b", "n2", 1, 0), _copy("a", "n1", 1, 0, "a-0", "a-1")])
    assert str(err.value.message) == "a on n1 is in use by a-0, a-1; stop those replicas first"
