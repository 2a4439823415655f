"""In-allocation serving (``xhpc.local``, ``xhpc run-server``) with a real (stdlib) engine
process: which of the job's GPUs each server gets, its key, its stop, and what a failed start
leaves (nothing). The job is played by its environment (SLURM_JOB_ID, SLURM_JOB_GPUS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import xhpc
from xhpc.agent import local
from xhpc.errors import AdmissionError, EngineError, UnsafePathError, ValidationError
from xhpc.models import EngineKind
from xhpc.settings import EngineConfig, ModelEntry, XhpcConfig

ENGINES = Path(__file__).resolve().parents[1] / "data" / "engines"
ROOT = Path(__file__).resolve().parents[2]
ECHO = (
    "{python}", "-m", "echo_engine", "--host", "{host}", "--port", "{port}",
    "--served-model", "{served_model}",
)  # fmt: skip


def config(tmp_path: Path, command: tuple[str, ...] = ECHO) -> XhpcConfig:
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    engine = EngineConfig(
        python=Path(sys.executable),
        command=list(command),
        env={"PYTHONPATH": str(ENGINES)},
        startup_timeout_s=20,
    )
    return XhpcConfig(
        state_dir=tmp_path / "state",
        models={"m": ModelEntry(path=model, engine=EngineKind.COMMAND)},
        engines={EngineKind.COMMAND: engine},
        cpu_only=True,
    )


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process runs inside job 4242, which holds GPUs 1, 3, 5 and 6."""
    tmpdir = tmp_path / "job-tmp"
    tmpdir.mkdir()
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_GPUS": "1,3,5,6",
        "CUDA_VISIBLE_DEVICES": "1,3,5,6",
        "TMPDIR": str(tmpdir),
    }.items():
        monkeypatch.setenv(name, value)
    return tmpdir


def ask(base_url: str, key: str | None) -> tuple[int, dict[str, object]]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def answered_gpus(answer: dict[str, object]) -> str:
    """The echo engine answers with the CUDA_VISIBLE_DEVICES it was started with."""
    text = json.dumps(answer)
    return text.split("gpus=")[1].split('"')[0].split(" ")[0]


def test_servers_of_one_job_take_distinct_gpus_and_answer_only_with_their_key(
    tmp_path: Path, job: Path
) -> None:
    cfg = config(tmp_path)
    with xhpc.local("m", gpus=2, config=cfg) as first, xhpc.local("m", gpus=1, config=cfg) as two:
        assert len(set(first.gpus) | set(two.gpus)) == 3
        assert set(first.gpus) <= {1, 3, 5, 6} and set(two.gpus) <= {1, 3, 5, 6}
        for server in (first, two):
            status, answer = ask(server.base_url, server.api_key)
            assert status == 200, answer
            assert answered_gpus(answer) == ",".join(map(str, server.gpus))
            assert ask(server.base_url, None)[0] == 401
            assert ask(server.base_url, "someone-elses-guess")[0] == 401
        assert first.api_key != two.api_key
        with pytest.raises(AdmissionError, match="No available slot"):
            xhpc.local("m", gpus=2, config=cfg)  # one GPU left
        pids = [s.engine.engine.child.pid for s in (first, two) if s.engine.engine]
        url = first.base_url
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/models", timeout=5)
    claims = local.claims_dir(os.environ)
    assert list(claims.glob("*.json")) == []  # released: the next server has all four
    with xhpc.local("m", gpus=4, config=cfg) as whole:
        assert whole.gpus == (1, 3, 5, 6)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def test_a_claim_left_by_a_dead_process_is_ignored_and_an_idle_gpu_comes_first(
    tmp_path: Path, job: Path
) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    claims = local.claims_dir(os.environ)
    (claims / "gone.json").write_text(json.dumps({"pid": int(dead.stdout), "gpus": [1, 3, 5]}))
    (claims / "live.json").write_text(json.dumps({"pid": os.getpid(), "gpus": [1]}))
    assert local.claim_gpus(3, os.environ, "mine") == (3, 5, 6)
    with pytest.raises(AdmissionError, match="No available slot"):
        local.claim_gpus(1, os.environ, "more")
    local.release_gpus(os.environ, "mine")
    assert local.claim_gpus(1, os.environ, "again") == (3,)


def test_gpus_are_named_as_the_job_sees_them_where_slurm_constrains_devices() -> None:
    env = {"SLURM_JOB_GPUS": "2,3,7", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert local.visible_devices((3, 7), env) == "1,2"
    assert local.visible_devices((3, 7), {"SLURM_JOB_GPUS": "2,3,7"}) == "3,7"


def test_a_claims_directory_someone_else_could_write_is_refused(tmp_path: Path, job: Path) -> None:
    path = job / f"xhpc-local-{os.getuid()}-4242"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    with pytest.raises(UnsafePathError, match="group or others may use it"):
        local.claim_gpus(1, os.environ, "x")


def test_no_gpus_in_the_job_or_bad_input_is_a_clear_error_and_starts_nothing(
    tmp_path: Path, job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path)
    monkeypatch.delenv("SLURM_JOB_GPUS")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(AdmissionError, match="holds no GPUs"):
        xhpc.local("m", gpus=1, config=cfg)
    with pytest.raises(ValidationError, match="unknown engine"):
        xhpc.local("m", gpus=0, engine="nope", config=cfg)
    with pytest.raises(ValidationError, match="gpus must be"):
        xhpc.local("m", gpus=-1, config=cfg)
    with pytest.raises(ValidationError, match="each must be one word of"):  # as admission says
        xhpc.local("m", gpus=0, engine_args=("--x", "; rm -rf /"), config=cfg)
    with xhpc.local("m", gpus=0, config=cfg) as cpu:  # a CPU node: no GPU asked, none given
        assert cpu.gpus == () and ask(cpu.base_url, cpu.api_key)[0] == 200


def test_an_engine_that_dies_on_start_fails_with_its_log_and_leaves_no_claim(
    tmp_path: Path, job: Path
) -> None:
    crash = (*ECHO, "--crash-if", "/")
    cfg = config(tmp_path, crash)
    with pytest.raises(EngineError, match="exited with code") as err:
        xhpc.local("m", gpus=1, config=cfg)
    assert "engine log:" in str(err.value)
    assert list(local.claims_dir(os.environ).glob("*.json")) == []
    assert [p.name for p in job.iterdir()] == [f"xhpc-local-{os.getuid()}-4242"]  # no scratch


def test_run_server_serves_until_sigterm_and_writes_its_key_owner_only(
    tmp_path: Path, job: Path
) -> None:
    cfg = config(tmp_path)
    site = tmp_path / "site.toml"
    site.write_text(
        f'cpu_only = true\n[models.m]\npath = "{tmp_path / "models" / "m"}"\nengine = "command"\n'
        f'[engines.command]\npython = "{sys.executable}"\n'
        f"command = {json.dumps(list(ECHO))}\nstartup_timeout_s = 20\n"
        f'[engines.command.env]\nPYTHONPATH = "{ENGINES}"\n'
    )
    assert cfg.models  # the same model as the API tests, from a site file this time
    ready = tmp_path / "server.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XHPC_")}
    env.update(XHPC_SITE_CONFIG=str(site), XHPC_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "xhpc", "run-server", "m", "--gpus", "2", "--ready-file",
         str(ready)],
        env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "run-server did not get ready"
            time.sleep(0.05)
        facts = json.loads(ready.read_text())
        key_file = Path(facts["key_file"])
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert key not in " ".join(Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0"))
        status, answer = ask(facts["base_url"], key)
        assert status == 200 and answered_gpus(answer) == ",".join(map(str, facts["gpus"]))
        assert ask(facts["base_url"], None)[0] == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not ready.exists() and not key_file.exists()
        assert list(local.claims_dir(os.environ).glob("*.json")) == []
        assert proc.stderr is not None and key not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
