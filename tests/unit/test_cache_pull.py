"""`xhpc cache pull` on the broker's side and the CLI's, with real SQLite and a recording Slurm
stand-in: bad input submits nothing; a good pull submits one job, and the copy is recorded in the
ledger (the shared copy: path, size, digest) once the job's result is there; a job that ended
without one fails the pull."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.conftest import Run, one_error_line
from tests.unit.test_cache_ledger import SubmitOnly
from xhpc.agent.staging import main as job_main
from xhpc.broker.api import control_app
from xhpc.broker.desks import pull_desk
from xhpc.broker.desks.cache_desk import CacheDesk
from xhpc.cli.admin import cache as cache_cli
from xhpc.cli.context import Ctx
from xhpc.client.control import Client
from xhpc.errors import ValidationError, XhpcError
from xhpc.models import JobInfo
from xhpc.settings import XhpcConfig
from xhpc.store import Store
from xhpc.weights import CacheCopy, CachePull, PullStatus, PullView, tree_digest

DIGEST = "sha256:" + "b" * 64


@pytest.fixture
def incoming(tmp_path: Path) -> Path:
    root = tmp_path / "incoming" / "tiny"
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"w" * 4096)
    return root


@pytest.fixture
def config(tmp_path: Path) -> XhpcConfig:
    (tmp_path / "models").mkdir()
    return XhpcConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "models_dir": str(tmp_path / "models"),
            "slurm": {"partition": "gpu", "default_time": "00:20:00"},
            "models": {
                "tiny-llama": {"path": "tiny-llama", "engine": "transformers"},
                "elsewhere": {"path": "other/dir", "engine": "transformers"},
            },
        }
    )


@pytest.fixture
def slurm() -> SubmitOnly:
    return SubmitOnly()


@pytest.fixture
def desk(config: XhpcConfig, tmp_path: Path, slurm: SubmitOnly) -> CacheDesk:
    return CacheDesk(config, Store(tmp_path / "x.db"), slurm, "b1", "/venv/bin/python")  # type: ignore[arg-type]


def run_job(view: PullView, script: str) -> int:
    """What the job does on its node: the script's own command line, run here."""
    line = next(ln for ln in script.splitlines() if ln.startswith("exec "))
    argv = line.split()[line.split().index("xhpc.agent.staging") + 1 :]
    assert argv[0] == "pull" and argv[3] == view.model
    return job_main(argv)


async def test_a_pull_submits_one_job_and_records_the_copy_when_it_reports(
    desk: CacheDesk, slurm: SubmitOnly, incoming: Path, config: XhpcConfig
) -> None:
    view = await desk.pulls.submit(CachePull(model="tiny-llama", source=str(incoming)))
    assert view.status is PullStatus.SUBMITTED and view.job_id == "501"
    assert view.path == str(config.models_dir / "tiny-llama")  # type: ignore[operator]
    (script,) = slurm.scripts
    assert f"-m xhpc.agent.staging pull {incoming} {config.models_dir} tiny-llama " in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --time=00:20:00" in script
    assert "--gres" not in script and "--nodelist" not in script and "--replace" not in script
    # before the job reports: running in Slurm, nothing recorded
    await desk.pulls.refresh([JobInfo(job_id="501", raw_job_id=501, name="x", state="RUNNING")])
    assert desk.pulls.view(view.id).status is PullStatus.SUBMITTED
    assert desk.ledger.shared("tiny-llama") is None
    assert run_job(view, script) == 0
    await desk.pulls.refresh([])
    done = desk.pulls.view(view.id)
    assert done.status is PullStatus.DONE and done.ended_at is not None
    digest, size = tree_digest(incoming)
    assert done.recorded is not None
    assert (done.recorded.path, done.recorded.digest, done.recorded.size_bytes) == (
        view.path,
        digest,
        size,
    )
    shared = [c for c in await desk.copies() if c.node is None]  # `xhpc cache ls`
    assert [(c.model, c.digest) for c in shared] == [("tiny-llama", digest)]


async def test_a_hostile_source_path_is_one_quoted_word_of_the_script(
    desk: CacheDesk, slurm: SubmitOnly, incoming: Path
) -> None:
    hostile = incoming.parent / "in'; echo pwned $(id) `x`"
    incoming.rename(hostile)
    await desk.pulls.submit(CachePull(model="m", source=str(hostile)))
    (script,) = slurm.scripts
    assert f"pull {shlex.quote(str(hostile))} " in script
    assert shlex.split(script.splitlines()[-1])[6] == str(hostile)  # exec PY -I -m MOD pull SRC


async def test_a_failed_job_fails_the_pull_and_records_nothing(
    desk: CacheDesk, slurm: SubmitOnly, incoming: Path, config: XhpcConfig
) -> None:
    dest = config.models_dir / "tiny-llama"  # type: ignore[operator]
    dest.mkdir()
    (dest / "config.json").write_text('{"other": 1}')
    view = await desk.pulls.submit(CachePull(model="tiny-llama", source=str(incoming)))
    assert run_job(view, slurm.scripts[0]) == 1
    await desk.pulls.refresh([])
    failed = desk.pulls.view(view.id)
    assert failed.status is PullStatus.FAILED and "pass --replace" in str(failed.error)
    assert failed.recorded is None and desk.ledger.shared("tiny-llama") is None
    # --replace: the job is told so, and the new copy is recorded
    again = await desk.pulls.submit(
        CachePull(model="tiny-llama", source=str(incoming), replace=True)
    )
    assert slurm.scripts[1].rstrip().endswith(" --replace")
    assert run_job(again, slurm.scripts[1]) == 0
    await desk.pulls.refresh([])
    assert desk.pulls.view(again.id).replaced
    assert desk.ledger.shared("tiny-llama").digest == tree_digest(incoming)[0]  # type: ignore[union-attr]


async def test_a_job_gone_without_a_result_fails_after_a_grace(
    desk: CacheDesk, incoming: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = await desk.pulls.submit(CachePull(model="m", source=str(incoming)))
    await desk.pulls.refresh([])  # first seen gone: within the grace
    assert desk.pulls.view(view.id).status is PullStatus.SUBMITTED
    monkeypatch.setattr(pull_desk, "GONE_GRACE_S", 0.0)
    (desk.pulls.jobs_dir / "pull-0000beef.json").write_text("{not json")  # skipped, logged
    await desk.pulls.refresh([])
    failed = desk.pulls.view(view.id)
    assert failed.status is PullStatus.FAILED
    assert failed.error == f"job {view.job_id} ended without a result: see {view.output}"


async def test_bad_input_submits_nothing(
    desk: CacheDesk, slurm: SubmitOnly, incoming: Path, tmp_path: Path
) -> None:
    (tmp_path / "link").symlink_to(incoming)
    bare = tmp_path / "bare"
    bare.mkdir()
    cases = {
        str(tmp_path / "absent"): "no such directory",
        str(tmp_path / "link"): "is a symlink",
        str(bare): "has no config.json",
        str(incoming / "config.json"): "is not a directory",
    }
    for source, message in cases.items():
        with pytest.raises(ValidationError, match=message):
            await desk.pulls.submit(CachePull(model="m", source=source))
    with pytest.raises(ValidationError, match=r"loads its weights from .*other/dir"):
        await desk.pulls.submit(CachePull(model="elsewhere", source=str(incoming)))
    for bad in ({"model": "../etc"}, {"source": "hf://org/m"}, {"source": "relative/dir"}):
        with pytest.raises(ValueError):
            CachePull.model_validate({"model": "m", "source": str(incoming), **bad})
    assert slurm.scripts == []
    await desk.pulls.submit(CachePull(model="m", source=str(incoming)))
    with pytest.raises(ValidationError, match="a pull of m is in progress"):
        await desk.pulls.submit(CachePull(model="m", source=str(incoming)))
    assert len(slurm.scripts) == 1


async def test_no_models_dir_no_pull(
    config: XhpcConfig, tmp_path: Path, slurm: SubmitOnly, incoming: Path
) -> None:
    bare = config.model_copy(update={"models_dir": None})
    desk = CacheDesk(bare, Store(tmp_path / "y.db"), slurm, "b1", "/p")  # type: ignore[arg-type]
    with pytest.raises(XhpcError, match=r"models_dir\) is not set"):
        await desk.pulls.submit(CachePull(model="m", source=str(incoming)))
    assert slurm.scripts == []


async def test_pull_endpoints_over_the_control_api(desk: CacheDesk, incoming: Path) -> None:
    class Service:
        config = XhpcConfig()
        cache = desk

    app = control_app(Service())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        body = json.dumps({"model": "m", "source": str(incoming)})
        view = await (await client.post("/v1/cache/pull", data=body)).json()
        assert view["status"] == "submitted"
        got = await (await client.get(f"/v1/cache/pulls/{view['id']}")).json()
        assert got == view
        assert (await client.get("/v1/cache/pulls/..%2Fetc")).status == 404
        hub = await client.post("/v1/cache/pull", data='{"model": "m", "source": "hf://o/m"}')
        assert hub.status == 400 and "offline only" in (await hub.json())["error"]["message"]


# -- the CLI (the whole entry point, a stand-in broker) ------------------------------------------
class FakeBroker:
    """Answers a pull with a submitted view, then ``then`` at the first status call."""

    def __init__(self, then: PullView) -> None:
        self.then = then
        self.calls: list[tuple[str, str, Any]] = []

    def post(self, path: str, body: str) -> Any:
        self.calls.append(("POST", path, json.loads(body)))
        first = self.then.model_copy(update={"status": PullStatus.SUBMITTED, "recorded": None})
        return json.loads(first.model_dump_json())

    def get(self, path: str) -> Any:
        self.calls.append(("GET", path, None))
        return json.loads(self.then.model_dump_json())


def _view(status: PullStatus, **extra: Any) -> PullView:
    copy = CacheCopy(model="m", path="/models/m", size_bytes=2048, digest=DIGEST)
    return PullView(
        id="0123abcd",
        model="m",
        source="/in/m",
        path="/models/m",
        job_id="77",
        status=status,
        submitted_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
        recorded=copy if status is PullStatus.DONE else None,
        output="/state/cache/pull-0123abcd-77.out",
        **extra,
    )


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(then: PullView) -> FakeBroker:
        fake = FakeBroker(then)
        monkeypatch.setattr(Ctx, "broker", property(lambda _: Client.over(fake)))  # type: ignore[arg-type]
        monkeypatch.setattr(cache_cli, "WAIT_POLL_S", 0.0)
        return fake

    return use


def test_cli_pull_submits_and_waits_for_the_recorded_copy(
    xhpc: Run, broker: Any, incoming: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = broker(_view(PullStatus.DONE))
    monkeypatch.chdir(incoming.parent)
    result = xhpc("cache", "pull", "m", "--from", "tiny")
    assert result.code == 0, result.err
    assert result.out.startswith("pulling /in/m into /models/m: job 77")
    assert fake.calls == [
        ("POST", "/v1/cache/pull", {"model": "m", "source": str(incoming)})
    ]  # a relative DIR is sent absolute; the defaults are not sent (xhpc.wire.request_json)
    result = xhpc("cache", "pull", "m", "--from", str(incoming), "--replace", "--wait", "--json")
    assert result.code == 0, result.err
    shown = json.loads(result.out)
    assert shown["status"] == "done" and shown["recorded"]["digest"] == DIGEST
    assert fake.calls[-1] == ("GET", "/v1/cache/pulls/0123abcd", None)
    result = xhpc("cache", "pull", "m", "--from", str(incoming), "--wait")
    assert result.out == f"pulled m: /models/m (2.0 KiB, {DIGEST})\n"


def test_cli_pull_failure_and_bad_input_are_one_line(
    xhpc: Run, broker: Any, incoming: Path
) -> None:
    fake = broker(_view(PullStatus.FAILED, error="/models/m holds other weights"))
    result = xhpc("cache", "pull", "m", "--from", str(incoming), "--wait")
    assert result.code != 0
    assert "pull of m failed: /models/m holds other weights" in one_error_line(result)
    calls = len(fake.calls)
    for args, message in (
        (("hf://org/m",), "names a model hub, and this site pulls offline only"),
        (("org/m",), "names a model hub"),
        ((str(incoming), "--name"), "no such option"),
    ):
        result = xhpc("cache", "pull", "m", "--from", *args)
        assert result.code != 0 and message in result.err, result.err
    result = xhpc("cache", "pull", "bad/name", "--from", str(incoming))
    assert result.code == 2 and "MODEL: invalid model name" in one_error_line(result)
    assert len(fake.calls) == calls  # nothing reached the broker
