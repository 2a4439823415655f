"""The weights cache ledger with real SQLite and a recording Slurm stand-in: what agents report
they staged, `cache ls` (the shared store digested once), and rm/prune, which never remove what
a live replica uses and remove node copies by a short job on their node."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from xhpc.broker.api import control_app
from xhpc.broker.desks.cache_desk import CacheDesk
from xhpc.errors import NotFoundError, ValidationError, XhpcError
from xhpc.models import EngineKind, ReplicaState, StagedCopy
from xhpc.records import DeploymentRecord, ReplicaRecord
from xhpc.settings import XhpcConfig
from xhpc.store import ReplicaRow, Store
from xhpc.weights import CachePrune, CacheRemove, tree_digest

GIB = 1024**3
T0 = datetime(2026, 1, 1, tzinfo=UTC)
DIGEST = "sha256:" + "a" * 64


class SubmitOnly:
    """The Slurm client's submit; the scripts it was given."""

    def __init__(self) -> None:
        self.scripts: list[str] = []

    async def submit(self, script: Path) -> str:
        self.scripts.append(script.read_text())
        return str(500 + len(self.scripts))

    async def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> None:
        raise AssertionError("the cache cancels nothing")


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models" / "tiny-llama"
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"w" * 4096)
    return tmp_path / "models"


@pytest.fixture
def config(tmp_path: Path, models_dir: Path) -> XhpcConfig:
    return XhpcConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "models_dir": str(models_dir),
            "cache": {"local_dir": "/scratch/xhpc"},
            "models": {"tiny-llama": {"path": "tiny-llama", "engine": "transformers"}},
        }
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "xhpc.db")


@pytest.fixture
def slurm() -> SubmitOnly:
    return SubmitOnly()


@pytest.fixture
def desk(config: XhpcConfig, store: Store, slurm: SubmitOnly) -> CacheDesk:
    return CacheDesk(config, store, slurm, "b1", "/venv/bin/python")  # type: ignore[arg-type]


def _replica(store: Store, replica_id: str, state: ReplicaState = ReplicaState.QUEUED) -> None:
    dep = replica_id.rsplit("-", 1)[0]
    if dep not in {d.name for d in store.deployments()}:
        row = DeploymentRecord(
            name=dep,
            model=dep,
            model_path=f"/m/{dep}",
            engine=EngineKind.VLLM,
            gpus=1,
            created_at=T0,
        )
        store.create_deployment(row, [])
    idx = int(replica_id.rsplit("-", 1)[1])
    rep = ReplicaRecord(
        replica_id=replica_id,
        deployment=dep,
        index=idx,
        state=ReplicaState.CREATING,
        engine=EngineKind.VLLM,
        created_at=T0,
        updated_at=T0,
    )
    store.add_replicas(dep, [rep])
    if state is not ReplicaState.CREATING:
        with store.session() as s:  # straight to ``state``: the test needs no history
            row = s.get(ReplicaRow, replica_id)
            assert row is not None
            row.state = state.value
            s.add(row)


def _staged(model: str, gib: int = 1) -> StagedCopy:
    return StagedCopy(
        model=model, path=f"/scratch/xhpc/u/{model}", size_bytes=gib * GIB, digest=DIGEST
    )


async def test_ls_digests_the_shared_store_once_and_shows_staged_copies_and_users(
    desk: CacheDesk, store: Store, models_dir: Path
) -> None:
    _replica(store, "tiny-llama-0")
    desk.staged("tiny-llama-0", "n2", _staged("tiny-llama"))
    copies = await desk.copies()
    shared, local = copies
    assert (shared.model, shared.node) == ("tiny-llama", None)
    assert (shared.digest, shared.size_bytes) == tree_digest(models_dir / "tiny-llama")
    assert (local.node, local.users, local.in_use_by) == (
        "n2",
        ("tiny-llama-0",),
        ("tiny-llama-0",),
    )
    assert local.last_used_at is not None
    # computed once: a changed file is not digested again while the path stands
    (models_dir / "tiny-llama" / "config.json").write_text('{"x": 1}')
    assert (await desk.copies())[0].digest == shared.digest
    assert desk.holders("tiny-llama") == frozenset({"n2"})


async def test_rm_refuses_a_copy_a_live_replica_uses(desk: CacheDesk, store: Store) -> None:
    _replica(store, "tiny-llama-0", ReplicaState.QUEUED)
    desk.staged("tiny-llama-0", "n2", _staged("tiny-llama"))
    with pytest.raises(ValidationError, match="in use by tiny-llama-0; stop those replicas first"):
        await desk.remove(CacheRemove(model="tiny-llama", node="n2"))
    assert desk.holders("tiny-llama") == frozenset({"n2"})


async def test_rm_of_an_ended_replicas_copy_runs_a_job_on_its_node_and_forgets_it(
    desk: CacheDesk, store: Store, slurm: SubmitOnly
) -> None:
    _replica(store, "tiny-llama-0", ReplicaState.STOPPED)
    desk.staged("tiny-llama-0", "n2", _staged("tiny-llama"))
    desk.staged("tiny-llama-0", "n3", _staged("tiny-llama"))
    dry = await desk.remove(CacheRemove(model="tiny-llama", node="n2", dry_run=True))
    assert [c.node for c in dry.removed] == ["n2"] and slurm.scripts == []
    done = await desk.remove(CacheRemove(model="tiny-llama", node="n2"))
    assert [c.node for c in done.removed] == ["n2"]
    (script,) = slurm.scripts
    assert "#SBATCH --nodelist=n2" in script
    assert "-m xhpc.agent.staging evict /scratch/xhpc tiny-llama" in script
    assert "--gres" not in script
    assert desk.holders("tiny-llama") == frozenset({"n3"})
    with pytest.raises(NotFoundError, match="no node-local copy of 'tiny-llama' on n2"):
        await desk.remove(CacheRemove(model="tiny-llama", node="n2"))


async def test_prune_keeps_each_node_under_budget_by_last_use(
    desk: CacheDesk, store: Store, slurm: SubmitOnly
) -> None:
    for model in ("a", "b", "c"):
        _replica(store, f"{model}-0", ReplicaState.STOPPED)
        desk.staged(f"{model}-0", "n1", _staged(model, 10))
    _replica(store, "a-1", ReplicaState.READY)
    desk.staged("a-1", "n1", _staged("a", 10))  # a: used last, and alive
    out = await desk.prune(CachePrune(budget_bytes=10 * GIB, dry_run=True))
    assert [c.model for c in out.removed] == ["b", "c"] and out.dry_run
    out = await desk.prune(CachePrune(budget_bytes=0))
    assert [c.model for c in out.removed] == ["b", "c"]
    assert out.kept == ("n1: 10.0 GiB left over the budget of 0 B: in use (a)",)
    assert len(slurm.scripts) == 1
    assert [c.model for c in desk.ledger.copies() if c.node] == ["a"]


async def test_removal_needs_the_local_dir_setting(
    config: XhpcConfig, store: Store, slurm: SubmitOnly
) -> None:
    bare = config.model_copy(update={"cache": config.cache.model_copy(update={"local_dir": None})})
    desk = CacheDesk(bare, store, slurm, "b1", "/venv/bin/python")  # type: ignore[arg-type]
    desk.staged("x-0", "n1", _staged("x"))
    with pytest.raises(XhpcError, match=r"\[cache\] local_dir"):
        await desk.remove(CacheRemove(model="x"))


async def test_cache_endpoints_over_the_control_api(desk: CacheDesk, store: Store) -> None:
    class Service:
        config = XhpcConfig()
        cache = desk

    app = control_app(Service())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        desk.staged("m-0", "n1", _staged("m"))
        listed = await (await client.get("/v1/cache")).json()
        assert [(c["model"], c["node"]) for c in listed] == [("m", "n1"), ("tiny-llama", None)]
        resp = await client.post("/v1/cache/prune", data='{"budget_bytes": -1}')
        assert resp.status == 400
        resp = await client.post("/v1/cache/rm", data='{"model": "m", "dry_run": true}')
        assert (await resp.json())["removed"][0]["node"] == "n1"
