"""The digest a replica's agent checks node-local weights against comes from the broker's
ledger, through the agent's owner-only spec file: never from the node. On a model's first use
the agent's fresh copy brings the shared copy's digest into the ledger."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.unit.test_broker_service import RecordingSlurm
from xhpc.broker.service import BrokerService
from xhpc.models import AgentSpec, NodeInfo, ServeRequest, StagedCopy
from xhpc.settings import XhpcConfig
from xhpc.store import Store
from xhpc.weights import tree_digest

pytestmark = pytest.mark.security


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models" / "tiny-llama"
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"w" * 4096)
    return tmp_path / "models"


@pytest.fixture
def service(tmp_path: Path, models_dir: Path, idle_nodes: list[NodeInfo]) -> BrokerService:
    config = XhpcConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "models_dir": str(models_dir),
            "cache": {"local_dir": "/scratch/xhpc"},
            "models": {"tiny-llama": {"path": "tiny-llama", "engine": "command"}},
            "engines": {"command": {"command": ["/bin/true"]}},
        }
    )
    store = Store(tmp_path / "state" / "x.db")
    return BrokerService(config, store, RecordingSlurm(idle_nodes, store))


async def _spec(service: BrokerService, name: str) -> tuple[AgentSpec, Path]:
    dep = await service.serve(ServeRequest(model="tiny-llama", name=name))
    rdir = Path(str(service.store.replica(dep.replicas[0].replica_id).replica_dir))
    return AgentSpec.model_validate_json((rdir / "spec.json").read_text()), rdir


def _fresh(source: Path, **kw: object) -> StagedCopy:
    digest, size = tree_digest(source)
    fields: dict[str, object] = {
        "model": "tiny-llama",
        "path": "/scratch/xhpc/u/tiny-llama",
        "size_bytes": size,
        "digest": digest,
        "source": str(source),
    }
    return StagedCopy.model_validate({**fields, **kw})


@pytest.mark.adversarial
async def test_the_spec_carries_the_ledgers_digest_of_the_shared_copy_owner_only(
    service: BrokerService, models_dir: Path
) -> None:
    """Failed on 6d94085 before the fix: the agent's spec carried no digest of the shared copy,
    so a node-local copy could only be checked against a record on the node itself."""
    first, _ = await _spec(service, "first")
    assert first.stage_dir == "/scratch/xhpc" and first.weights_digest is None  # first use
    shared = models_dir / "tiny-llama"
    digest, size = tree_digest(shared)
    service.cache.ledger.record("tiny-llama", None, str(shared), size, digest)
    spec, rdir = await _spec(service, "second")
    assert spec.weights_digest == digest and spec.model_path == str(shared)
    assert stat.S_IMODE((rdir / "spec.json").stat().st_mode) == 0o600
    assert digest not in (rdir / "job.sbatch").read_text()  # the spec file, never argv


async def test_a_ledger_digest_of_another_path_is_not_passed_on(
    service: BrokerService, models_dir: Path
) -> None:
    service.cache.ledger.record(
        "tiny-llama", None, "/elsewhere/tiny-llama", 1, "sha256:" + "1" * 64
    )
    spec, _ = await _spec(service, "moved")
    assert spec.weights_digest is None


async def test_a_first_fresh_copy_records_the_shared_digest_for_the_next_replicas(
    service: BrokerService, models_dir: Path
) -> None:
    shared = models_dir / "tiny-llama"
    service.cache.staged("tiny-llama-0", "n1", _fresh(shared))
    known = service.cache.ledger.shared("tiny-llama")
    assert known is not None and (known.path, known.digest) == (str(shared), tree_digest(shared)[0])
    spec, _ = await _spec(service, "next")
    assert spec.weights_digest == known.digest


async def test_only_a_fresh_copy_of_the_catalogs_shared_path_records_its_digest(
    service: BrokerService, tmp_path: Path
) -> None:
    """A directory served by path that happens to share the catalog model's name, or a copy
    found on the node, says nothing about the shared store's copy."""
    other = tmp_path / "mine" / "tiny-llama"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"other": 1}')
    service.cache.staged("tiny-llama-0", "n1", _fresh(other))
    assert service.cache.ledger.shared("tiny-llama") is None
    shared = tmp_path / "models" / "tiny-llama"
    service.cache.staged("tiny-llama-1", "n2", _fresh(shared, reused=True))
    assert service.cache.ledger.shared("tiny-llama") is None
