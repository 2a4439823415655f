"""The weights cache on the real dev cluster: staging under concurrent jobs (one copy per node,
both replicas use it), the ledger, cache-aware placement, rm/prune by a job on the node, and a
pull into the shared store by a job, then served by name.

The dev cluster's nodes share one filesystem, so "node-local" here is one directory for all
three; the ledger still keys copies by the node each job ran on (SLURMD_NODENAME)."""

from __future__ import annotations

import getpass
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PLACEHOLDER_ENGINE, Xhpc, own_xhpc, wait_for
from xhpc.weights import tree_digest

pytestmark = pytest.mark.cluster

CACHE_TOML = PLACEHOLDER_ENGINE + '\n[cache]\nlocal_dir = "@STATE@/local"\n'


@pytest.fixture
def cached(dev_cluster: Path, tiny_model: Path) -> Iterator[Xhpc]:
    with own_xhpc(tiny_model, CACHE_TOML) as x:
        yield x


def _copies(x: Xhpc) -> list[dict[str, Any]]:
    rows = x.json("cache", "ls")
    assert isinstance(rows, list)
    return rows


def _local(x: Xhpc, node: str) -> dict[str, Any] | None:
    return next((c for c in _copies(x) if c["node"] == node), None)


def _serve(x: Xhpc, name: str, *args: str) -> list[str]:
    dep = x.json("serve", "tiny-llama", "--name", name, "--engine", "command", "--detach", *args)
    assert isinstance(dep, dict)
    return [r["replica_id"] for r in dep["replicas"]]


def _copy_dir(x: Xhpc) -> Path:
    return x.state_dir / "local" / getpass.getuser() / "tiny-llama"


def test_two_replicas_on_one_node_stage_one_copy_and_both_use_it(
    cached: Xhpc, tiny_model: Path
) -> None:
    ids = _serve(cached, "tiny-llama", "--replicas", "2", "--nodelist", "n1")

    def both_recorded() -> dict[str, Any] | None:
        copy = _local(cached, "n1")
        return copy if copy and sorted(copy["users"]) == sorted(ids) else None

    copy = wait_for(both_recorded, 120, "both replicas to report the staged copy")
    assert isinstance(copy, dict)
    assert copy["digest"] == tree_digest(tiny_model)[0]
    assert sorted(copy["in_use_by"]) == sorted(ids)
    base = _copy_dir(cached).parent
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == ["tiny-llama"]
    assert [p for p in base.iterdir() if ".tmp-" in p.name] == []
    shared = next(c for c in _copies(cached) if c["node"] is None and c["model"] == "tiny-llama")
    assert shared["digest"] == copy["digest"]
    listed = {m["name"]: m for m in cached.json("models", "list")}  # type: ignore[union-attr]
    assert listed["tiny-llama"]["cached"] == ["n1", "shared"]  # the catalog says where it is
    # never removed while a live replica uses it
    refused = cached.run("cache", "rm", "tiny-llama", "--node", "n1", check=False)
    assert refused.returncode != 0
    assert refused.stderr.strip().startswith("error: tiny-llama on n1 is in use by")
    assert _copy_dir(cached).is_dir()
    cached.run("stop", "tiny-llama")


def test_placement_prefers_the_idle_node_that_holds_the_weights(cached: Xhpc) -> None:
    # Two deployments of one model under their own names: the cache knows the weights by the
    # catalog's name, whatever the deployment is called.
    _serve(cached, "first", "--nodelist", "n2")
    wait_for(lambda: _local(cached, "n2"), 120, "the copy on n2 in the ledger")
    cached.run("stop", "first")
    (rid,) = _serve(cached, "second")

    def node() -> str | None:
        row = next((r for r in cached.json("ps") if r["replica_id"] == rid), None)  # type: ignore[union-attr]
        return row["node"] if row and row["node"] else None

    assert wait_for(node, 60, "Slurm to place the replica") == "n2"
    log = (cached.state_dir / "broker.log").read_text()
    assert "n2: idle, 4 GPU(s) free, holds tiny-llama locally" in log
    cached.run("stop", "second")


def test_prune_removes_an_unused_copy_by_a_job_on_its_node(cached: Xhpc) -> None:
    _serve(cached, "tiny-llama", "--nodelist", "n3")
    wait_for(lambda: _local(cached, "n3"), 120, "the copy on n3 in the ledger")
    dry = cached.run("cache", "prune", "--budget", "0", "--dry-run").stdout
    assert "would remove" not in dry  # in use: nothing to remove
    cached.run("stop", "tiny-llama")
    dry = cached.run("cache", "prune", "--budget", "0", "--dry-run").stdout
    assert "would remove tiny-llama on n3" in dry and _copy_dir(cached).is_dir()
    out = cached.run("cache", "prune", "--budget", "0").stdout
    assert "removing tiny-llama on n3" in out
    assert _local(cached, "n3") is None
    wait_for(lambda: not _copy_dir(cached).exists(), 60, "the eviction job to remove the copy")


def test_a_second_deployment_on_the_node_reuses_the_copy(cached: Xhpc) -> None:
    _serve(cached, "first", "--nodelist", "n1")
    first = wait_for(lambda: _local(cached, "n1"), 120, "the copy on n1")
    assert isinstance(first, dict)
    cached.run("stop", "first")
    marker = _copy_dir(cached).stat().st_ino
    (rid,) = _serve(cached, "second", "--nodelist", "n1")

    def reused() -> bool:
        copy = _local(cached, "n1")
        return bool(copy and rid in copy["users"])

    wait_for(reused, 120, "the new replica to report the copy")
    assert _copy_dir(cached).stat().st_ino == marker  # not copied again
    cached.run("stop", "second")


def test_a_pulled_model_is_in_the_ledger_with_its_digest_and_serves_by_name(
    dev_cluster: Path, tiny_model: Path, unique_name: str
) -> None:
    store = Path(tempfile.mkdtemp(prefix="xt-models-", dir="/tmp"))  # the site's models_dir
    incoming = Path(tempfile.mkdtemp(prefix="xt-in-", dir="/tmp")) / "weights"
    shutil.copytree(tiny_model, incoming)
    digest = tree_digest(tiny_model)[0]
    try:
        with own_xhpc(store / "tiny-llama") as x:  # models_dir: store, empty
            absent = x.run("serve", "tiny-llama", "--name", unique_name, check=False)
            assert absent.returncode != 0 and "not staged" in absent.stderr
            bad = x.run("cache", "pull", "tiny-llama", "--from", str(store / "none"), check=False)
            assert bad.returncode != 0 and bad.stderr.startswith("error: --from ")
            assert len(bad.stderr.splitlines()) == 1 and x.my_jobs() == []

            view = x.json("cache", "pull", "tiny-llama", "--from", str(incoming), "--wait")
            assert isinstance(view, dict) and view["status"] == "done", view
            assert view["recorded"]["digest"] == digest
            assert tree_digest(store / "tiny-llama")[0] == digest
            assert [p.name for p in store.iterdir() if ".pull-" in p.name] == []
            shared = [c for c in _copies(x) if c["node"] is None]
            assert [(c["model"], c["path"], c["digest"]) for c in shared] == [
                ("tiny-llama", str(store / "tiny-llama"), digest)
            ]
            shown = x.run("cache", "ls").stdout
            assert digest.removeprefix("sha256:")[:12] in shown
            again = x.json("cache", "pull", "tiny-llama", "--from", str(incoming), "--wait")
            assert isinstance(again, dict) and again["unchanged"]

            dep = x.json(
                "serve", "tiny-llama", "--name", unique_name, "--engine", "transformers",
                "--timeout", "240",
            )  # fmt: skip
            assert isinstance(dep, dict)
            assert dep["model_path"] == str(store / "tiny-llama")
            assert [r["state"] for r in dep["replicas"]] == ["READY"]
            x.run("stop", unique_name)
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(incoming.parent, ignore_errors=True)
