"""What a batch may name as its model: a key's user (delegated) names a catalog model or a
deployment it may use, never a path, and gets one answer for everything else; an online batch
goes only to a deployment its caller may use (owner, the key's account, admins)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from xhpc.access import Caller, ModelAccess
from xhpc.broker.batches.batch_models import batch_model, check_online
from xhpc.errors import NotFoundError
from xhpc.models import EngineKind
from xhpc.records import DeploymentRecord
from xhpc.settings import ModelEntry, XhpcConfig

ANN_KEY = Caller(user="ann", uid=-1, delegated=True, key_id="0123456789ab", account="lab")
BOB_KEY = Caller(user="bob", uid=-1, delegated=True, key_id="ba0123456789")
BOB = Caller(user="bob", uid=1001)
ADMIN = Caller(user="root", uid=0, admin=True)
ACCESS = {
    "carols": ModelAccess(model="carols", owner="carol", account="lab"),
    "bobs": ModelAccess(model="bobs", owner="bob"),
}


def _record(name: str) -> DeploymentRecord | None:
    if name not in ACCESS:
        return None
    return DeploymentRecord(
        name=name,
        model=name,
        model_path=f"/weights/{name}",
        engine=EngineKind.VLLM,
        gpus=1,
        created_at=datetime.now(UTC),
    )


@pytest.fixture
def config(tmp_path: Path) -> XhpcConfig:
    for name in ("m", "theirs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return XhpcConfig(state_dir=tmp_path / "state", models={"m": ModelEntry(path=tmp_path / "m")})


@pytest.mark.security
def test_a_key_s_user_names_no_path_and_gets_one_answer(config: XhpcConfig, tmp_path: Path) -> None:
    names = [str(tmp_path / "theirs"), str(tmp_path / "none"), "../theirs", "~/x", "bobs",
             "no-such", "a\nb", ""]  # fmt: skip
    for who in (ANN_KEY, BOB_KEY):
        for name in names:
            if who is BOB_KEY and name == "bobs":
                continue
            with pytest.raises(NotFoundError) as info:
                batch_model(name, who, config, ACCESS, _record)
            shown = name if name.isprintable() else repr(name)
            assert info.value.message == f"unknown model {shown!r}"
    assert batch_model("m", BOB_KEY, config, ACCESS, _record).path == tmp_path / "m"
    # A deployment its key may use: the deployment's own weights and engine.
    carols = batch_model("carols", ANN_KEY, config, ACCESS, _record)  # the key's account's
    assert carols.path == Path("/weights/carols") and carols.engine is EngineKind.VLLM
    assert batch_model("bobs", BOB_KEY, config, ACCESS, _record).name == "bobs"
    # On the socket, acting as oneself: a local directory, as `xhpc serve` takes one.
    assert batch_model(str(tmp_path / "theirs"), BOB, config, ACCESS, _record).name == "theirs"


@pytest.mark.security
def test_an_online_batch_goes_only_to_a_deployment_its_caller_may_use() -> None:
    check_online("carols", ANN_KEY, ACCESS)  # shared with the key's account
    check_online("bobs", BOB_KEY, ACCESS)
    check_online("bobs", BOB, ACCESS)
    check_online("carols", ADMIN, ACCESS)
    check_online("carols", None, ACCESS)  # the broker itself
    for who, name in [(BOB_KEY, "carols"), (BOB, "carols"), (ANN_KEY, "bobs"), (BOB, "gone")]:
        with pytest.raises(NotFoundError, match="you may use"):
            check_online(name, who, ACCESS)
    admin_key = Caller(user="root", uid=-1, delegated=True, key_id="ffffffffffff")
    with pytest.raises(NotFoundError):
        check_online("carols", admin_key, ACCESS)  # a key's user is never an admin here
